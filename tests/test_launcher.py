"""The local launcher: command builders (unit) and real launches with embedded servers.

The launches run `python -m arealite.launcher.local` as a subprocess with a
trivial training script, real embedded servers and a real torchrun, and check
that no child survives by the pids the launcher and the script recorded.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arealite.config.schema import ArealiteConfig
from arealite.launcher.local import ExitCode, LocalLauncher
from arealite.server.command_line import (
    embedded_server_command,
    masked,
    server_command,
    sglang_server_command,
)

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- command builders


def _cfg(**sections) -> ArealiteConfig:
    return ArealiteConfig.model_validate(sections)


def _flag(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_sglang_command_from_config():
    cfg = _cfg(
        actor={"model_path": "/models/actor"},
        experiment={"seed": 7},
        launch={"server_backend": "sglang"},
        server={"host": "127.0.0.2", "dtype": "float16", "api_key": "s3cret",
                "sglang": {"tp_size": 2, "mem_fraction_static": 0.7, "context_length": 4096,
                           "extra_args": ["--enable-metrics", "--log-level", "warning"]}},
    )
    cmd = server_command(cfg, 31000, index=3)
    assert _flag(cmd, "--model-path") == "/models/actor"  # server.model_path unset -> actor's
    assert _flag(cmd, "--host") == "127.0.0.2" and _flag(cmd, "--port") == "31000"
    assert _flag(cmd, "--tp-size") == "2" and _flag(cmd, "--mem-fraction-static") == "0.7"
    assert _flag(cmd, "--dtype") == "float16"
    assert _flag(cmd, "--random-seed") == "10"  # experiment.seed + server index
    assert _flag(cmd, "--context-length") == "4096"
    assert "--skip-tokenizer-init" in cmd
    assert cmd[-3:] == ["--enable-metrics", "--log-level", "warning"]  # verbatim, last
    # The key never goes on a command line: a wrapper adds it from the environment in-process.
    assert "--api-key" not in cmd and "s3cret" not in " ".join(cmd)
    assert cmd[:3] == [sys.executable, "-m", "arealite.launcher.sglang_server"]
    assert masked(["x", "--api-key", "s3cret"]) == "x --api-key ***"


def test_sglang_wrapper_adds_the_key_from_the_environment(monkeypatch):
    import runpy

    from arealite.launcher import sglang_server

    ran = {}
    monkeypatch.setattr(runpy, "run_module", lambda name, **kw: ran.update(name=name, argv=list(sys.argv)))
    monkeypatch.setattr(sys, "argv", ["wrapper", "--port", "1"])
    monkeypatch.setenv("AREALITE_SERVER_API_KEY", "k3y")
    sglang_server.main()
    assert ran == {"name": "sglang.launch_server", "argv": ["wrapper", "--port", "1", "--api-key", "k3y"]}


def test_sglang_command_defaults():
    cfg = _cfg(server={"model_path": "/m", "random_seed": 100,
                       "sglang": {"skip_tokenizer_init": False}},
               launch={"server_backend": "sglang"})
    cmd = sglang_server_command(cfg, 30000)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]  # no key: SGLang itself
    assert _flag(cmd, "--dtype") == "bfloat16"  # auto means bf16 on GPUs
    assert _flag(cmd, "--random-seed") == "100"
    for absent in ("--skip-tokenizer-init", "--api-key", "--context-length"):
        assert absent not in cmd


def test_embedded_command_from_config():
    cfg = _cfg(server={"model_path": "/m", "max_batch_size": 8, "context_length": 512,
                       "api_key": "k", "prompt_cache_entries": 5}, experiment={"seed": 3})
    cmd = server_command(cfg, 30001, index=1)
    assert cmd[:3] == [sys.executable, "-m", "arealite.server"]
    assert _flag(cmd, "--port") == "30001" and _flag(cmd, "--random-seed") == "4"
    assert _flag(cmd, "--max-batch-size") == "8" and _flag(cmd, "--context-length") == "512"
    assert _flag(cmd, "--prompt-cache-entries") == "5"
    assert "--dtype" not in cmd  # auto: the server decides
    assert "--api-key" not in cmd and "k" not in cmd  # the key travels in the environment
    assert _flag(embedded_server_command(_cfg(server={"model_path": "/m", "dtype": "bfloat16"}), 1),
                 "--dtype") == "bfloat16"


def test_command_without_model_path_names_the_fields():
    with pytest.raises(ValueError, match="server.model_path and actor.model_path"):
        server_command(_cfg(), 30000)


def test_embedded_command_is_accepted_by_the_server_parser():
    from arealite.server.args import parse_args

    cfg = _cfg(server={"model_path": "/m", "dtype": "float32", "context_length": 64, "api_key": "x"})
    os.environ["AREALITE_SERVER_API_KEY"] = "x"  # what the launchers set (`common.server_env`)
    try:
        args = parse_args(embedded_server_command(cfg, 4321)[3:])
    finally:
        del os.environ["AREALITE_SERVER_API_KEY"]
    assert (args.port, args.dtype, args.context_length, args.api_key) == (4321, "float32", 64, "x")


# ---------------------------------------------------------------- real launches

SCRIPT = r'''
import json, os, sys, time, urllib.request
out = os.environ["OUT_FILE"]
mode = os.environ.get("MODE", "ok")
addrs = os.environ.get("AREALITE_SERVER_ADDRS", "").split(",")
health = []
for a in addrs:
    with urllib.request.urlopen(f"http://{a}/health", timeout=5) as r:
        health.append(r.status)
record = {"addrs": addrs, "health": health, "argv": sys.argv[1:], "pid": os.getpid(),
          "ppid": os.getppid(), "api_key": os.environ.get("AREALITE_SERVER_API_KEY"),
          "rank": os.environ.get("RANK"), "affinity": sorted(os.sched_getaffinity(0)),
          "nice": os.getpriority(os.PRIO_PROCESS, 0), "servers_nice": []}
for pid in filter(str.isdigit, os.listdir("/proc") if addrs[0] else []):  # the first server's niceness
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        if b"arealite.server" in cmd and addrs[0].rpartition(":")[2].encode() in cmd:
            record["servers_nice"].append(os.getpriority(os.PRIO_PROCESS, int(pid)))
    except OSError:
        pass
with open(out + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(out + ".tmp", out)
print("hello from the trainer", flush=True)
if mode == "sleep":
    time.sleep(120)
if mode == "fail":
    sys.exit(3)
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _assert_all_gone(pids: list[int], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "child processes survived the launcher"


class Launch:
    """One `python -m arealite.launcher.local` run in a subprocess."""

    def __init__(self, tmp_path: Path, model_dir: Path, mode: str, n_servers: int = 1,
                 extra: tuple[str, ...] = (), script: str = SCRIPT, pythonpath: tuple[Path, ...] = ()):
        self.tmp = tmp_path
        self.script = tmp_path / "train.py"
        self.script.write_text(script)
        self.cfg = tmp_path / "cfg.yaml"
        self.cfg.write_text(
            f"experiment: {{output_root: {tmp_path / 'runs'}, name: exp, trial: t1}}\n"
            f"actor: {{model_path: {model_dir}}}\n"
            f"launch: {{n_servers: {n_servers}, server_startup_timeout_s: 120}}\n")
        self.out = tmp_path / "record.json"
        self.stdout = open(tmp_path / "launcher.out", "w+b")
        self.stderr = open(tmp_path / "launcher.err", "w+b")
        env = dict(os.environ, OUT_FILE=str(self.out), MODE=mode, OMP_NUM_THREADS="1",
                   AREALITE_LAUNCHER_GRACE_S="5", PYTHONPATH=os.pathsep.join(map(str, (REPO, *pythonpath))))
        env.pop("AREALITE_SERVER_ADDRS", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "arealite.launcher.local", str(self.script),
             "--config", str(self.cfg), *extra],
            stdout=self.stdout, stderr=self.stderr, env=env, cwd=tmp_path)

    def err(self) -> str:
        return (self.tmp / "launcher.err").read_text(errors="replace")

    def out_text(self) -> str:
        return (self.tmp / "launcher.out").read_text(errors="replace")

    def pids(self) -> dict[str, int]:
        return {m[0]: int(m[1]) for m in re.findall(r"started (\w+) \(pid (\d+)\)", self.err())}

    def wait_record(self, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while not self.out.exists():
            assert self.proc.poll() is None, f"launcher exited early:\n{self.err()}"
            assert time.monotonic() < deadline, f"the script never ran:\n{self.err()}"
            time.sleep(0.2)
        return json.loads(self.out.read_text())

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def all_pids(self, record: dict | None) -> list[int]:
        pids = list(self.pids().values())
        if record:
            pids += [record["pid"], record["ppid"]]
        return pids

    @property
    def log_dir(self) -> Path:
        return self.tmp / "runs" / "exp" / "t1" / "logs"


@pytest.mark.slow
def test_launch_two_servers_runs_script_and_cleans_up(tmp_path, micro_model_dir):
    run = Launch(tmp_path, micro_model_dir, "ok", n_servers=2,
                 extra=("rollout.consumer_batch_size=4", "server.api_key=topsecret"))
    code = run.wait()
    assert code == ExitCode.OK, run.err()
    record = json.loads(run.out.read_text())
    assert len(record["addrs"]) == 2 and len(set(record["addrs"])) == 2
    assert all(a.startswith("127.0.0.1:") for a in record["addrs"]), record["addrs"]  # server.host
    assert record["health"] == [200, 200], "the script could reach every server"
    # The key override is not passed on (it would show in `ps`): the key travels in the env.
    assert record["argv"] == ["--config", str(run.cfg), "rollout.consumer_batch_size=4"]
    assert record["rank"] == "0", "the script ran under torchrun"
    assert record["api_key"] == "topsecret"  # passed in the environment
    for name in ("server0.log", "server1.log", "trainer.log"):
        assert (run.log_dir / name).stat().st_size > 0, name
    assert "hello from the trainer" in (run.log_dir / "trainer.log").read_text()
    assert "hello from the trainer" in run.out_text(), "trainer output is echoed"
    for name in ("server0.log", "server1.log"):
        assert "topsecret" not in (run.log_dir / name).read_text()
    assert "topsecret" not in run.err()
    assert set(run.pids()) == {"server0", "server1", "trainer"}
    _assert_all_gone(run.all_pids(record))


@pytest.mark.slow
def test_server_killed_mid_run_stops_everything(tmp_path, micro_model_dir):
    run = Launch(tmp_path, micro_model_dir, "sleep")
    record = run.wait_record()
    os.kill(run.pids()["server0"], signal.SIGKILL)
    code = run.wait(60)
    assert code == ExitCode.SERVER_DIED, run.err()
    assert "server0" in run.err() and "died" in run.err()
    _assert_all_gone(run.all_pids(record))


@pytest.mark.slow
def test_trainer_failure_stops_servers(tmp_path, micro_model_dir):
    run = Launch(tmp_path, micro_model_dir, "fail")
    code = run.wait()
    assert code == ExitCode.TRAINER_FAILED, run.err()
    record = json.loads(run.out.read_text())
    _assert_all_gone(run.all_pids(record))


@pytest.mark.slow
def test_sigint_tears_everything_down(tmp_path, micro_model_dir):
    run = Launch(tmp_path, micro_model_dir, "sleep")
    record = run.wait_record()
    run.proc.send_signal(signal.SIGINT)
    code = run.wait(60)
    assert code == ExitCode.INTERRUPTED == 130, run.err()
    _assert_all_gone(run.all_pids(record))


@pytest.mark.slow
def test_server_that_cannot_start_reports_its_log(tmp_path, micro_model_dir):
    broken = tmp_path / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # passes the config check, not the server's load
    run = Launch(tmp_path, micro_model_dir, "ok", extra=(f"server.model_path={broken}",))
    code = run.wait()
    assert code == ExitCode.SERVER_START_FAILED, run.err()
    assert "server0" in run.err() and "exited with code" in run.err()
    assert "Last lines of" in run.err() and str(run.log_dir / "server0.log") in run.err()
    assert not run.out.exists(), "the trainer must not start"
    _assert_all_gone(run.all_pids(None))


def test_bad_override_exits_before_starting_anything(tmp_path, micro_model_dir):
    run = Launch(tmp_path, micro_model_dir, "ok", extra=("launch.n_servers=-1",))
    assert run.wait() == ExitCode.BAD_CONFIG
    assert "launch.n_servers" in run.err()
    assert run.pids() == {}


# A trainer that starts a local OpenEnv server (as `rollout.workflow: openenv` with env_class does).
OPENENV_SCRIPT = SCRIPT.replace("print(\"hello from the trainer\", flush=True)", r'''
from arealite.environments.openenv_server import LocalEnvServer
env_server = LocalEnvServer("user_pkg.openenv_guess:GuessEnv", "user_pkg.openenv_guess:GuessAction",
                            "user_pkg.openenv_guess:GuessObservation")
env_server.start()
with open(out + ".env", "w") as f:
    f.write(str(env_server.proc.pid))
''')


@pytest.mark.slow
def test_an_openenv_server_the_trainer_starts_is_listed_and_stopped(tmp_path, micro_model_dir):
    pytest.importorskip("openenv.core")
    run = Launch(tmp_path, micro_model_dir, "sleep", script=OPENENV_SCRIPT, pythonpath=(REPO / "tests",))
    record = run.wait_record()
    env_file = Path(str(run.out) + ".env")
    deadline = time.monotonic() + 120
    while "openenv0" not in run.pids() or not env_file.exists():
        assert time.monotonic() < deadline, f"the OpenEnv server is not listed:\n{run.err()}"
        time.sleep(0.2)
    env_pid = int(env_file.read_text())
    assert run.pids()["openenv0"] == env_pid, "listed with the launcher's other children"
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == ExitCode.TERMINATED, run.err()
    _assert_all_gone([env_pid, *run.all_pids(record)])


# ---------------------------------------------------------------- torchrun's store

STORE_PROBE = r'''
import json, os, pathlib, time
import torch.distributed as dist
dist.init_process_group("gloo")  # through torchrun's store, as the trainer joins
if dist.get_rank() == 0:
    print(json.dumps([os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])]), flush=True)
done = pathlib.Path(__file__).with_name("done")
while not done.exists():
    time.sleep(0.1)
dist.destroy_process_group()
'''


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on: its fds' socket inodes, looked up
    in /proc/net/tcp and tcp6 (state 0A), whose addresses are 32-bit words in host order."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    out = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                addr, port = fields[1].split(":")
                raw = bytes.fromhex(addr)
                ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
                out.add((str(ip), int(port, 16)))
    return out


def test_the_trainers_store_listens_on_the_master_address_alone(tmp_path):
    """torchrun's rendezvous store, which the ranks share, is bound to 127.0.0.1, not to
    every interface (as the weight-update store), and it is the only socket torchrun opens."""
    script = tmp_path / "probe.py"
    script.write_text(STORE_PROBE)
    launcher = LocalLauncher(_cfg(launch={"n_trainer_procs": 2}), str(script), None, [], tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen(launcher.trainer_command(), stdout=subprocess.PIPE, text=True, env=env)
    try:
        master_addr, master_port = json.loads(proc.stdout.readline())
        assert (_listening(proc.pid), master_addr) == ({("127.0.0.1", master_port)}, "127.0.0.1")
    finally:
        (tmp_path / "done").touch()
        assert proc.wait(60) == 0


ENV_RANK_PROBE = r'''
import os, pathlib, time
import torch.distributed as dist
from arealite.utils.dist import init_default_group
init_default_group("gloo")  # RANK, WORLD_SIZE, MASTER_* set as the Ray launcher sets them
pathlib.Path(os.environ["PROBE_DIR"], f"up{dist.get_rank()}").touch()
while not pathlib.Path(os.environ["PROBE_DIR"], "done").exists():
    time.sleep(0.1)
dist.destroy_process_group()
'''


def test_a_group_launched_without_torchrun_serves_its_store_on_the_master_address(tmp_path):
    """Ranks started with torchrun's environment by another launcher (Ray): rank 0's store is
    bound to MASTER_ADDR, not to every interface, and both ranks join through it."""
    from arealite.utils.dist import free_port

    script = tmp_path / "probe.py"
    script.write_text(ENV_RANK_PROBE)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PROBE_DIR=str(tmp_path), WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    ranks = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r)}) for r in range(2)]
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"up{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in ranks), "the group did not form"
            time.sleep(0.1)
        assert {addr for addr, p in _listening(ranks[0].pid) if p == port} == {"127.0.0.1"}
    finally:
        (tmp_path / "done").touch()
        assert [p.wait(60) for p in ranks] == [0, 0]


# ---------------------------------------------------------------- CPU pinning


def test_cpu_plan_splits_cores_between_servers_and_trainer():
    from arealite.launcher.local import cpu_plan

    assert cpu_plan(1, 1, [0, 1]) == ([[0]], [1])
    assert cpu_plan(2, 5, list(range(8))) == ([[0, 1, 2], [3, 4]], [5, 6, 7])
    assert cpu_plan(2, None, [0, 1]) == ([[], []], [])
    with pytest.raises(ValueError, match="server_cpus=2"):
        cpu_plan(1, 2, [0, 1])


def test_server_cpus_checks_name_the_field():
    from arealite.config.launch_checks import check_launch
    from arealite.config.loader import ConfigError

    n = len(os.sched_getaffinity(0))
    for launch, words in (
        ({"n_servers": 1, "server_cpus": n}, "leaves no core for the trainer"),
        ({"n_servers": 0, "server_addrs": ["127.0.0.1:3000"], "server_cpus": 1}, "launch.n_servers = 0"),
        ({"n_servers": 3, "server_cpus": 2}, "fewer than launch.n_servers = 3"),
    ):
        if launch.get("server_cpus", 0) >= n and "fewer" in words:
            continue
        with pytest.raises(ConfigError, match=re.escape("launch.server_cpus")) as e:
            check_launch(_cfg(launch=launch))
        assert words in str(e.value)


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_server_cpus_pins_server_and_trainer_to_their_cores(tmp_path, micro_model_dir):
    run = Launch(tmp_path, micro_model_dir, "ok", extra=("launch.server_cpus=1",))
    assert run.wait() == ExitCode.OK, run.err()
    cpus = sorted(os.sched_getaffinity(0))
    assert f"started server0 (pid {run.pids()['server0']}) on " in run.err()
    assert f"on cores {cpus[:1]}" in run.err() and f"trainer processes pinned to cores {cpus[1:]}" in run.err()
    record = json.loads(run.out.read_text())
    assert record["affinity"] == cpus[1:]
    assert record["servers_nice"] == [0] and record["nice"] == 0  # neither yields to the other
