"""``python -m arealite.server --model-path P --host 127.0.0.1 --port N [...]``

With ``--sim``, simulated servers instead (a GPU cost model in place of the model): the
same command line is handed to ``python -m arealite.sim``."""

from __future__ import annotations

import asyncio
import runpy
import sys

from .args import parse_args
from .lifecycle import run_until_signalled

SIM_FLAG = "--sim"


def main(argv: list[str] | None = None) -> None:
    """Run the embedded server (or, with ``--sim``, simulated ones) until SIGINT/SIGTERM."""
    argv = sys.argv[1:] if argv is None else argv
    if SIM_FLAG in argv:
        # By module name: the simulator builds on this package, never the other way round.
        sys.argv = [sys.argv[0], *argv]
        runpy.run_module("arealite.sim", run_name="__main__", alter_sys=True)
        return
    args = parse_args(argv)

    async def serve_embedded(stop: asyncio.Event) -> None:
        from .app import serve  # once logging is configured (the import loads torch and transformers)

        await serve(args, stop)

    run_until_signalled(args.log_level, serve_embedded)


if __name__ == "__main__":
    main()
