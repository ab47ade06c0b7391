"""The code sandbox contains what misbehaving code does: a fork bomb, an infinite loop, a
memory bomb, huge output, writes outside its directory, a network call. The test process
(standing for the trainer) is unharmed, and the code rewards built on it score correctly."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from arealite.sandbox import isolation, run_python
from arealite.config.agent import SandboxConfig
from arealite.reward.code import extract_code, run_snippet, unit_test_reward

TIGHT = SandboxConfig(cpu_s=2, wall_s=4, memory_mb=256, file_size_mb=1, max_processes=8, max_output_bytes=4096)
ISOLATED = isolation() != "rlimits"


def _alive() -> None:
    """The test process can still fork, write and allocate."""
    res = run_python("print(6 * 7)", TIGHT)
    assert res.ok and res.stdout.strip() == "42"


def test_a_plain_snippet_runs_in_its_own_directory():
    res = run_python("import os\nopen('out.txt', 'w').write('hi')\nprint(open('out.txt').read(), os.getcwd())",
                     TIGHT, files={"data/in.txt": "x"})
    assert res.ok and res.stdout.startswith("hi ") and "arealite-sandbox-" in res.stdout
    assert not Path(res.stdout.split()[1]).exists()  # removed afterwards


def test_infinite_loop_is_stopped_by_the_cpu_limit():
    t0 = time.monotonic()
    res = run_python("while True:\n    pass", TIGHT)
    assert not res.ok and (res.signal in ("SIGXCPU", "SIGKILL") or res.timed_out)
    assert time.monotonic() - t0 < TIGHT.wall_s + 3
    _alive()


def test_sleeping_forever_is_stopped_by_the_wall_clock():
    res = run_python("import time\ntime.sleep(600)", TIGHT)
    assert res.timed_out and res.returncode is None and res.duration_s < TIGHT.wall_s + 3


def test_memory_bomb_is_refused():
    res = run_python("x = bytearray(4 * 2**30)\nprint('allocated')", TIGHT)
    assert not res.ok and "allocated" not in res.stdout and "MemoryError" in res.stderr
    _alive()


def test_huge_output_is_capped():
    res = run_python("import sys\nfor _ in range(10**5):\n    sys.stdout.write('x' * 1000)", TIGHT)
    assert res.output_truncated and len(res.stdout) == TIGHT.max_output_bytes


def test_a_huge_file_is_refused():
    res = run_python("open('big', 'wb').write(b'x' * 10 * 2**20)", TIGHT)
    assert not res.ok and "File too large" in res.stderr


def test_fork_bomb_is_contained_and_cleaned_up():
    code = ("import os, time\n"
            "for _ in range(10000):\n"
            "    try:\n        os.fork()\n    except OSError:\n        break\n"
            "time.sleep(60)\n")
    t0 = time.monotonic()
    res = run_python(code, TIGHT)
    assert res.timed_out and time.monotonic() - t0 < TIGHT.wall_s + 5
    if isolation() == "namespaces-root":  # its own uid: nothing of it is left
        leftover = [p for p in os.listdir("/proc") if p.isdigit() and _uid(p) in range(61000, 62000)]
        assert leftover == [] or all(_zombie(p) for p in leftover)
    _alive()


def _uid(pid: str) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


def _zombie(pid: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(not ISOLATED, reason="needs root or user namespaces")
def test_writes_outside_the_directory_fail(tmp_path):
    target = tmp_path / "escape.txt"
    for path in (target, Path("/tmp/arealite_escape.txt"), Path("/dev/shm/arealite_escape.txt")):
        res = run_python(f"open({str(path)!r}, 'w').write('x')", TIGHT)
        assert not res.ok and not path.exists(), (path, res.stderr)


@pytest.mark.skipif(not ISOLATED, reason="needs root or user namespaces")
def test_no_network():
    res = run_python("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=2)\nprint('connected')",
                     TIGHT)
    assert not res.ok and "connected" not in res.stdout
    assert "unreachable" in res.stderr or "refused" in res.stderr or "Errno" in res.stderr


def test_unit_test_reward_and_snippet_tool():
    from arealite.reward import code

    code.configure(TIGHT)
    good = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```"
    bad = "```python\ndef add(a, b):\n    return a - b\n```"
    tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"
    assert extract_code(good).startswith("def add")
    assert unit_test_reward("p", good, tests=tests) == 1.0
    assert unit_test_reward("p", bad, tests=tests) == 0.0
    assert unit_test_reward("p", "```python\nwhile True: pass\n```", tests=tests) == 0.0
    code.configure(SandboxConfig())


async def test_snippet_tool_reports_output_and_errors():
    assert (await run_snippet("print(12 * 34)")).strip() == "408"
    assert "ZeroDivisionError" in await run_snippet("1 / 0")
