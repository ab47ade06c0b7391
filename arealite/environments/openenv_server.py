"""A local OpenEnv environment server, started from a Python environment class.

``python -m arealite.environments.openenv_server --env mypkg.env:MyEnv --action mypkg.env:MyAction
--observation mypkg.env:MyObservation --port N`` serves the class with openenv's own
``create_app`` on 127.0.0.1 (one environment per session; ``max_concurrent_envs`` sessions).
`LocalEnvServer` starts that as a child process of the process that runs the episodes,
waits for its ``/health``, and stops it when that process exits (or dies: the child gets
SIGTERM with its parent). Under a launcher it is registered with it (`utils.procs.register_child`),
which lists it with the other processes of the run and stops it with them.
"""

from __future__ import annotations

import argparse
import atexit
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from arealite.utils.imports import import_callable
from arealite.utils.net import free_port
from arealite.utils.procs import register_child

INSTALL = "pip install 'arealite[envs]' (or pip install openenv-core)"


def import_openenv():  # -> the openenv.core module
    """openenv-core, or an error saying how to install it."""
    try:
        import openenv.core
    except ImportError as e:
        raise ValueError(f"rollout.workflow: openenv needs the openenv-core library ({e}); {INSTALL}") from None
    return openenv.core


class LocalEnvServer:
    """The child process serving ``env_class`` on 127.0.0.1; `start` is idempotent and thread-safe."""

    def __init__(self, env_class: str, action_class: str | None, observation_class: str | None,
                 max_sessions: int = 64, startup_timeout_s: float = 60.0):
        for name, value in (("action_class", action_class), ("observation_class", observation_class)):
            if not value:
                raise ValueError(f"rollout.workflow_kwargs.{name} is needed with env_class "
                                 "(module:Class of the environment's Action / Observation)")
        for name, value in (("env_class", env_class), ("action_class", action_class),
                            ("observation_class", observation_class)):
            import_callable(value, f"rollout.workflow_kwargs.{name}")  # fails here, not in the child
        self.args = ["--env", env_class, "--action", action_class, "--observation", observation_class,
                     "--max-sessions", str(max_sessions)]
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self._lock = threading.Lock()

    def start(self) -> str:
        """The server's URL, starting it (and waiting until it answers) on first call."""
        with self._lock:
            if self.proc is not None and self.proc.poll() is None and self.url:
                return self.url
            port = free_port()
            self.proc = subprocess.Popen([sys.executable, "-m", __name__, *self.args, "--port", str(port)])
            register_child("openenv", self.proc.pid)
            atexit.register(self.stop)
            self.url = f"http://127.0.0.1:{port}"
            self._wait_healthy()
            return self.url

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the OpenEnv server ({' '.join(self.args)}) exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the OpenEnv server ({' '.join(self.args)}) did not answer within "
                           f"{self.startup_timeout_s:g}s")

    def stop(self) -> None:
        """Terminate the child (kill it after 10 s)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", required=True, help="module:Class of an openenv Environment")
    ap.add_argument("--action", required=True, help="module:Class of its Action")
    ap.add_argument("--observation", required=True, help="module:Class of its Observation")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--max-sessions", type=int, default=64)
    a = ap.parse_args(argv)
    from arealite.utils.procs import die_with_parent

    die_with_parent()
    import uvicorn
    from openenv.core.env_server import create_fastapi_app

    env_cls = import_callable(a.env, "--env")
    # Several sessions at once only where the class says it is safe (openenv refuses otherwise).
    sessions = a.max_sessions if getattr(env_cls, "SUPPORTS_CONCURRENT_SESSIONS", False) else 1
    app = create_fastapi_app(env_cls, import_callable(a.action, "--action"),
                             import_callable(a.observation, "--observation"), max_concurrent_envs=sessions)
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
