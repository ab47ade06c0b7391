"""The main of a server process: logging, an event loop, SIGINT/SIGTERM, a prompt exit.

Shared by ``python -m arealite.server`` and ``python -m arealite.sim``: both serve until
they are signalled, then leave without the interpreter's slow teardown.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import sys
from typing import Awaitable, Callable, NoReturn


def run_until_signalled(log_level: str, serve: Callable[[asyncio.Event], Awaitable[None]]) -> NoReturn:
    """Run ``serve(stop)`` on uvloop until it returns; SIGINT/SIGTERM set ``stop``."""
    faulthandler.enable()  # a crash in native code leaves every thread's stack in the server log
    logging.basicConfig(
        level=log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    import uvloop

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(stop)
        logging.getLogger("arealite.server").info("server stopped")

    uvloop.run(run())
    # Everything is shut down and flushed; skip the slow interpreter teardown
    # of torch/transformers so that launchers and tests see a prompt exit.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)  # private-ok: os._exit is public API (exit without cleanup after the server shut down)
