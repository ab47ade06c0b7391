"""``python -m arealite.sim --model-path DIR [--sim-servers N | --sim-ports P1,P2,...] [--sim-* ...]``

Serves simulated inference servers until SIGINT/SIGTERM (`arealite.sim.serve`); every flag
of ``python -m arealite.server`` applies to each of them."""

from __future__ import annotations

import asyncio
import sys

from arealite.server.lifecycle import run_until_signalled


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and serve the simulated servers until signalled."""
    argv = sys.argv[1:] if argv is None else argv
    from .serve import parse_sim_args

    args, spec, ports, trace = parse_sim_args(argv)

    async def serve(stop: asyncio.Event) -> None:
        from .serve import serve_sim

        await serve_sim(args, spec, ports, trace, stop=stop)

    run_until_signalled(args.log_level, serve)


if __name__ == "__main__":
    main()
