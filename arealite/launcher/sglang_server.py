"""`python -m sglang.launch_server`, with the API key taken from the environment.

    AREALITE_SERVER_API_KEY=K python -m arealite.launcher.sglang_server --model-path P ...

SGLang reads its key from `--api-key` only. The launchers put the key in the
environment rather than on a command line (which `ps` shows to every user of the
machine, and which the launchers log); this wrapper appends the flag to
``sys.argv`` inside the process, where no other process can read it, then runs
SGLang's own entry point as ``__main__``.
"""

from __future__ import annotations

import os
import runpy
import sys

from arealite.config.run import ENV_SERVER_API_KEY


def main() -> None:
    key = os.environ.get(ENV_SERVER_API_KEY)
    if key and "--api-key" not in sys.argv:
        sys.argv += ["--api-key", key]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
