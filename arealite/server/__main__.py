"""``python -m arealite.server --model-path P --host 127.0.0.1 --port N [...]``

With ``--sim``, simulated servers (a GPU cost model instead of the model; `arealite.server.sim`)."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import sys

from .args import parse_args


def main(argv: list[str] | None = None) -> None:
    """Run the embedded server (or, with ``--sim``, simulated ones) until SIGINT/SIGTERM."""
    argv = sys.argv[1:] if argv is None else argv
    sim = None
    if "--sim" in argv:
        from .sim import parse_sim_args

        args, *sim = parse_sim_args(argv)
    else:
        args = parse_args(argv)
    faulthandler.enable()  # a crash in native code leaves every thread's stack in the server log
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    import uvloop

    from .app import serve

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if sim:
            from .sim import serve_sim

            await serve_sim(args, *sim, stop=stop)
        else:
            await serve(args, stop)
        logging.getLogger("arealite.server").info("server stopped")

    uvloop.run(run())
    # Everything is shut down and flushed; skip the slow interpreter teardown
    # of torch/transformers so that launchers and tests see a prompt exit.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)  # private-ok: os._exit is public API (exit without cleanup after the server shut down)


if __name__ == "__main__":
    main()
