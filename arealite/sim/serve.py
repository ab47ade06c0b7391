"""Simulated inference servers: ``python -m arealite.sim --model-path DIR [--sim-servers N] ...``.

Each is the embedded server's own HTTP app (routes, strict mode, limits, weight routes)
with `SimRunner` in place of the model thread, so only what a GPU computes is simulated
(`arealite.sim.cost_model`). ``--sim-servers N`` serves N of them from one process, one
event loop, on ports ``--port`` .. ``--port + N - 1`` (or the ports of ``--sim-ports``),
server ``i`` seeded ``--random-seed + i``; 256 fit on two cores.

``--model-path`` names a Hugging Face directory (a tiny one will do): its config gives
the vocabulary, EOS tokens and model class the protocol reports, and its weights are
what the weight routes receive and check, for real. The cost model's model is
``--sim-model``, whose bytes a weight update takes ``--sim-weight-gbps`` to move (its share
of them for one bucket of a distributed or shm update): the real load of the small model is
part of that transfer, so after it the server holds generation for what is left of the
simulated time (none when the real load took longer).

``python -m arealite.server --sim ...`` is the same command (``--sim`` is optional here).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import time
from pathlib import Path

from aiohttp import web

from arealite.utils.heap import freeze_heap

from arealite.server.app import EmbeddedServer, build_app, load_model
from arealite.server.args import ServerArgs, build_parser, parse_args
from arealite.server.limits import install_log_filter
from arealite.server.startup_request import self_url

from .cost_model import GPUS, MODELS, SimSpec, load_lengths
from .runner import SimRunner, sim_runner_class

logger = logging.getLogger("arealite.sim")

__all__ = ["SimServers", "add_sim_flags", "parse_sim_args", "serve_sim"]

#: Weight routes whose success is followed by the simulated transfer.
_LOAD_ROUTES = ("/update_weights_from_disk", "/update_weights_from_shm", "/update_weights_from_distributed")


def add_sim_flags(p: argparse.ArgumentParser) -> None:
    """The ``--sim*`` flags (the cost model; `SimSpec`'s fields)."""
    d = SimSpec()
    g = p.add_argument_group("simulation (docs/scale.md)")
    g.add_argument("--sim", action="store_true",
                   help="simulate generation with a cost model (implied here; it makes `python -m arealite.server` run this)")
    g.add_argument("--sim-servers", type=int, default=1, help="servers in this process (consecutive ports)")
    g.add_argument("--sim-ports", default=None, help="comma-separated ports, one per server (instead of --port)")
    g.add_argument("--sim-gpu", default=d.gpu, choices=sorted(GPUS))
    g.add_argument("--sim-model", default=d.model, choices=sorted(MODELS))
    g.add_argument("--sim-gpus-per-server", type=int, default=d.gpus_per_server)
    for name in ("mem_fraction", "mbu", "mfu_decode", "mfu_prefill", "step_overhead_ms", "length_median",
                 "length_sigma", "weight_gbps", "time_scale"):
        g.add_argument("--sim-" + name.replace("_", "-"), type=float, default=getattr(d, name))
    g.add_argument("--sim-lengths-file", default=None, help="response lengths to draw from, one per line")
    g.add_argument("--sim-trace", default=None,
                   help="at exit, write every request's rid and arrival time (wall clock) here, JSON lines")


def parse_sim_args(argv: list[str]) -> tuple[ServerArgs, SimSpec, list[int], str | None]:
    """The server's own flags, the cost model, the ports and the trace file; a bad value exits
    naming the flag. ``-h`` prints the simulation's flags, then the server's."""
    p = argparse.ArgumentParser(prog="python -m arealite.sim", add_help=False,
                                description="Simulated inference servers: the embedded server's protocol with a "
                                            "GPU cost model in place of the model (docs/scale.md).")
    add_sim_flags(p)
    if "-h" in argv or "--help" in argv:
        p.print_help()
        print()
        build_parser().print_help()
        p.exit()
    ns, rest = p.parse_known_args(argv)
    args = parse_args(rest)
    try:
        lengths = load_lengths(ns.sim_lengths_file) if ns.sim_lengths_file else ()
        fields = {f.name: getattr(ns, "sim_" + f.name) for f in dataclasses.fields(SimSpec)
                  if f.name not in ("lengths", "gpu_shape", "model_shape")}  # no flags: the planner's
        spec = SimSpec(**fields, lengths=lengths)
    except ValueError as e:
        p.error(str(e))
    if ns.sim_ports:
        try:
            ports = [int(x) for x in ns.sim_ports.split(",") if x.strip()]
        except ValueError:
            p.error(f"--sim-ports {ns.sim_ports!r} is not a comma-separated list of ports")
    else:
        if ns.sim_servers < 1:
            p.error(f"--sim-servers {ns.sim_servers} must be at least 1")
        ports = list(range(args.port, args.port + ns.sim_servers))
    if not ports or not all(1 <= x <= 65535 for x in ports):
        p.error(f"ports {ports[:4]}...: every port must be in 1..65535")
    return args, spec, ports, ns.sim_trace


async def _hold_for_transfer(server: EmbeddedServer, spec: SimSpec, request: web.Request, loaded_s: float) -> None:
    """After a weight route loaded what it received (in ``loaded_s`` real seconds): the rest of
    the simulated transfer of its share."""
    runner = server.runner
    assert isinstance(runner, SimRunner)
    share = 1.0
    if request.path != "/update_weights_from_disk":
        body = json.loads(await request.read())  # aiohttp keeps the body read by the handler
        n = 0
        for dt, shape in zip(body.get("dtypes", []), body.get("shapes", [])):
            size = 1
            for d in shape:
                size *= d
            n += size * (2 if "16" in str(dt) else 4 if "32" in str(dt) else 8)
        share = min(1.0, n / max(1, server.weights.total_bytes))
    await runner.hold(max(0.0, spec.transfer_s(share) - loaded_s / spec.time_scale))


def _transfer_middleware(server: EmbeddedServer, spec: SimSpec):
    @web.middleware
    async def simulated_transfer(request: web.Request, handler):
        start = time.perf_counter()
        response = await handler(request)
        if request.path in _LOAD_ROUTES and response.status == 200:
            await _hold_for_transfer(server, spec, request, time.perf_counter() - start)
        return response
    return simulated_transfer


class SimServers:
    """N simulated servers on one event loop (`start`, then `stop`)."""

    def __init__(self, args: ServerArgs, spec: SimSpec, ports: list[int], trace: str | None = None):
        self.args, self.spec, self.ports, self.trace = args, spec, ports, trace
        self.arrivals: list[tuple[str, float]] | None = [] if trace else None
        self.servers: list[EmbeddedServer] = []
        self.app_runners: list[web.AppRunner] = []
        self.warm_ups: list[asyncio.Task] = []

    async def start(self, on_failure) -> None:
        """Load the model once (shared: every server receives the same updates), then listen."""
        base = dataclasses.replace(self.args, device="cpu")
        model, tokenizer, device = await asyncio.to_thread(load_model, base)
        build = sim_runner_class(self.spec, self.arrivals)
        for i, port in enumerate(self.ports):
            args = dataclasses.replace(base, port=port, random_seed=base.random_seed + i)
            server = EmbeddedServer(args, model, tokenizer, device, runner_class=build)
            app = build_app(server)
            app.middlewares.append(_transfer_middleware(server, self.spec))
            runner = web.AppRunner(app, access_log=None, keepalive_timeout=args.idle_timeout_s,
                                   handler_cancellation=True, lingering_time=1.0, auto_decompress=False)
            await runner.setup()
            self.app_runners.append(runner)
            try:
                await web.TCPSite(runner, args.host, port).start()
            except OSError as e:
                raise SystemExit(f"cannot listen on {args.host}:{port}: {e}") from None
            self.servers.append(server)
            self.warm_ups.append(asyncio.create_task(server.warm_up.run(self_url(args.host, port), args.api_key,
                                                                        on_failure)))

    async def stop(self) -> None:
        for t in self.warm_ups:
            t.cancel()
        for r in self.app_runners:
            await r.cleanup()
        if self.trace and self.arrivals is not None:
            lines = "".join(json.dumps({"rid": rid, "t": t}) + "\n" for rid, t in self.arrivals)
            await asyncio.to_thread(Path(self.trace).write_text, lines)


async def serve_sim(args: ServerArgs, spec: SimSpec, ports: list[int], trace: str | None = None,
                    stop: asyncio.Event | None = None) -> None:
    """Serve the simulated servers until ``stop`` is set; logs one line when all are ready."""
    t0 = time.perf_counter()
    install_log_filter("arealite.sim", "arealite.server", "aiohttp.server", "aiohttp.web", "aiohttp.access")
    stop = stop if stop is not None else asyncio.Event()
    sims = SimServers(args, spec, ports, trace)
    try:
        await sims.start(stop.set)
        if args.freeze_gc:
            await asyncio.to_thread(freeze_heap)
        logger.info("arealite simulated servers ready on http://%s:%s (%d servers; %s x%d, model %s, KV %d tokens, "
                    "time scale %g; started in %.1fs)", args.host, _port_range(ports), len(ports), spec.gpu,
                    spec.gpus_per_server, spec.model, spec.kv_capacity_tokens, spec.time_scale,
                    time.perf_counter() - t0)
        await stop.wait()
    finally:
        await sims.stop()
    failed = [s for s in sims.servers if s.warm_up.status == "failed"]
    if failed:
        raise SystemExit(f"arealite simulated server on port {failed[0].args.port}: {failed[0].warm_up.failure}")


def _port_range(ports: list[int]) -> str:
    return str(ports[0]) if len(ports) == 1 else f"{ports[0]}..{ports[-1]}"
