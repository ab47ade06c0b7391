"""One process on a cluster node, run for a remote launcher: the body of a Ray actor.

The Ray launcher places one `ProcessHost` per server and per trainer rank (as
`ray.remote(ProcessHost)`, in a placement-group bundle). It starts its command in
a new session on its node, writes the output to a node-local file that the
launcher reads back in pieces (`read_log`) into the run directory, reports the
exit code (`poll`), and stops the whole process group (`stop`). No Ray import
here: the class is a plain object, testable alone.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from arealite.utils import procs
from arealite.utils.net import free_port, host_ip

#: Stands for this node's Python interpreter in a command (the driver's path may not exist here).
PYTHON = "{python}"


class ProcessHost:
    """Starts, watches and stops one command on the node it lives on."""

    def __init__(self, name: str, node_ip: str | None = None):
        self.name = name
        self._node_ip = node_ip
        self._dir = Path(tempfile.mkdtemp(prefix=f"arealite-{name}-"))
        self.log_path = self._dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self._descendants: set[int] = set()

    def node_ip(self) -> str:
        """This node's IP as the cluster sees it (Ray's view when under Ray)."""
        if self._node_ip is None:
            try:
                import ray

                self._node_ip = ray.util.get_node_ip_address()
            except ImportError:  # pragma: no cover - only used under Ray
                self._node_ip = host_ip()
        return self._node_ip

    def node_id(self) -> str:
        """Ray's id of this node ("" outside Ray)."""
        try:
            import ray

            return ray.get_runtime_context().get_node_id()
        except ImportError:  # pragma: no cover - only used under Ray
            return ""

    def free_port(self, host: str | None = None) -> int:
        """A TCP port free on this node right now (bound on `host`, default the node's IP)."""
        return free_port(host or self.node_ip())

    def pid(self) -> int:
        """The pid of this host itself (the Ray actor's worker process)."""
        return os.getpid()

    def start(self, cmd: Sequence[str], env: dict[str, str], cwd: str | None = None) -> int:
        """Start `cmd` (`PYTHON` as its first word: this node's interpreter) with this
        process's environment updated by `env`, in `cwd` if that exists here; returns its pid."""
        cmd = [sys.executable if c == PYTHON else c for c in cmd]
        full_env = dict(os.environ)
        full_env.update(env)
        with open(self.log_path, "ab", buffering=0) as log_file:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                env=full_env, cwd=cwd if cwd and os.path.isdir(cwd) else None, start_new_session=True,
                preexec_fn=lambda: procs.die_with_parent(signal.SIGKILL))
        return self.proc.pid

    def poll(self) -> int | None:
        """The command's exit code, or None while it runs (also None before `start`)."""
        if self.proc is None:
            return None
        code = self.proc.poll()
        if code is None:
            self._descendants.update(procs.descendants(self.proc.pid))
        return code

    def read_log(self, offset: int, max_bytes: int = 1 << 20) -> bytes:
        """Up to `max_bytes` of the command's output from byte `offset` on."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read(max_bytes)
        except OSError:
            return b""

    def _alive(self) -> list[int]:
        pids = ({self.proc.pid} if self.proc is not None else set()) | self._descendants
        return [p for p in pids if procs.is_alive(p)]

    def _signal(self, sig: int) -> None:
        if self.proc is not None:
            self._descendants.update(procs.descendants(self.proc.pid))
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in self._descendants:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM the command's process group (and every descendant seen), SIGKILL what
        is left after `grace_s`; returns the exit code (None if it never started)."""
        if self.proc is None:
            return None
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self._alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._alive():
            self._signal(signal.SIGKILL)
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def cleanup(self) -> None:
        """Remove the node-local log (the launcher has copied it by now)."""
        shutil.rmtree(self._dir, ignore_errors=True)
