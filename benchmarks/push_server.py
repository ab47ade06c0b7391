"""The embedded server the weight-push benchmarks publish to (`bench_weight_sync`, `bench_lora`).

Imported by those scripts after they put the repository on ``sys.path``.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from arealite.utils.net import free_port


def start_server(model_dir: Path, log: Path, extra_args: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """Start ``python -m arealite.server`` on ``model_dir`` (output to ``log``, `extra_args` added);
    wait until it is healthy and return the process and its ``host:port``."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "arealite.server", "--model-path", str(model_dir), "--port", str(port),
         *extra_args],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    addr = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://{addr}/health", timeout=1):
                return proc, addr
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("server did not become healthy")
