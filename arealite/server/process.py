"""Start an embedded server as a child process and wait until it answers.

Used by tests and benchmarks (the launcher has its own, more complete process
management). The server's output goes to a log file whose tail is shown when
it fails to start.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


class ServerProcess:
    """A running ``python -m arealite.server`` child; use as a context manager."""

    def __init__(self, model_path: str | os.PathLike, port: int, *, host: str = "127.0.0.1",
                 extra_args: list[str] | None = None, log_path: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None, threads: int | None = None):
        self.url = f"http://{host}:{port}"
        self.log_path = Path(log_path) if log_path else Path(f"/tmp/arealite_server_{port}.log")
        cmd = [sys.executable, "-m", "arealite.server", "--model-path", str(model_path),
               "--host", host, "--port", str(port), *(extra_args or [])]
        child_env = dict(os.environ if env is None else env)
        if threads is not None:
            child_env["OMP_NUM_THREADS"] = str(threads)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=child_env,
                                     start_new_session=True)

    def log_tail(self, n_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return "<no log>"

    def wait_healthy(self, timeout: float = 120.0) -> "ServerProcess":
        """Poll ``/health`` until it answers 200; raise with the log tail otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server at {self.url} not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
