"""Throughput of SGLangClient.agenerate against a raw aiohttp loop.

Both sides talk to the same instant server (a minimal aiohttp app in a
subprocess that answers every /generate with a fixed valid SGLang response), with
the same concurrency, in the same run. The ratio client/raw says what the
client's routing, retries bookkeeping, parsing and Completion building cost
(goal: >= 0.8). Client-side CPU time per request is reported too, since on a
busy machine the server can be the bottleneck of both.

    python benchmarks/bench_client.py            # 5000 requests, 64 concurrent, 3 rounds
    python benchmarks/bench_client.py --quick    # a short run

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiohttp
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arealite.api.types import GenerationRequest, SamplingParams  # noqa: E402
from arealite.config.schema import RolloutConfig  # noqa: E402
from arealite.inference_client.sglang_client import SGLangClient, _dumps, _loads  # noqa: E402

N_OUT = 16  # tokens in the fixed response
PROMPT = list(range(100, 164))  # 64 prompt tokens


def _fixed_response() -> bytes:
    ids = [1000 + i for i in range(N_OUT)]
    return _dumps({
        "output_ids": ids,
        "meta_info": {
            "finish_reason": {"type": "length"},
            "prompt_tokens": len(PROMPT),
            "completion_tokens": N_OUT,
            "output_token_logprobs": [[-0.5 - 0.01 * i, t, None] for i, t in enumerate(ids)],
            "weight_version": "3",
        },
    })


def serve(port: int) -> None:
    """The instant server: reads the body, answers the fixed response."""
    from aiohttp import web

    body = _fixed_response()

    async def generate(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/get_server_info", lambda r: web.json_response({"version": "0.5.23"}))
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _workers(n_requests: int, concurrency: int, one) -> float:
    """Run ``one()`` n_requests times over ``concurrency`` workers; return seconds."""
    left = n_requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await one()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0


async def run_raw(url: str, n: int, concurrency: int) -> tuple[float, float]:
    """Baseline: one session, pre-built payload, orjson both ways, minimal checks."""
    payload = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": N_OUT, "temperature": 1.0,
                                                         "top_p": 1.0, "top_k": -1},
               "return_logprob": True}
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 16)) as session:
        async def one() -> None:
            # A request id is part of the protocol (the client sends GenerationRequest.rid).
            body = _dumps({**payload, "rid": uuid.uuid4().hex})
            async with session.post(url + "/generate", data=body, headers=headers) as resp:
                data = _loads(await resp.read())
            assert len(data["output_ids"]) == N_OUT

        cpu0 = time.process_time()
        wall = await _workers(n, concurrency, one)
        return wall, time.process_time() - cpu0


async def run_client(addr: str, n: int, concurrency: int) -> tuple[float, float]:
    """The engine: a fresh GenerationRequest per call, full Completion back."""
    cfg = RolloutConfig(max_inflight_per_server=concurrency, request_timeout_s=60)
    async with SGLangClient([addr], cfg) as eng:
        await eng.initialize(timeout=30)
        sp = SamplingParams(max_new_tokens=N_OUT)

        async def one() -> None:
            c = await eng.agenerate(GenerationRequest(input_ids=PROMPT, sampling=sp))
            assert len(c.output_ids) == N_OUT

        cpu0 = time.process_time()
        wall = await _workers(n, concurrency, one)
        cpu = time.process_time() - cpu0
        assert eng.stats()["completed"] == n
        return wall, cpu


async def _wait_up(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the benchmark server at {url} did not start within {timeout:g}s")
            await asyncio.sleep(0.1)


async def bench(addr: str, n: int, concurrency: int, rounds: int) -> dict:
    url = f"http://{addr}"
    await _wait_up(url)
    await run_raw(url, min(n, 500), concurrency)  # warm-up both paths
    await run_client(addr, min(n, 500), concurrency)
    raw, cli = [], []
    for _ in range(rounds):  # interleaved, so background load hits both alike
        raw.append(await run_raw(url, n, concurrency))
        cli.append(await run_client(addr, n, concurrency))
    raw_rps = [n / w for w, _ in raw]
    cli_rps = [n / w for w, _ in cli]
    raw_cpu = statistics.median(c / n * 1e6 for _, c in raw)
    cli_cpu = statistics.median(c / n * 1e6 for _, c in cli)
    return {
        "requests": n,
        "concurrency": concurrency,
        "rounds": rounds,
        "raw_rps": round(max(raw_rps), 1),
        "client_rps": round(max(cli_rps), 1),
        "ratio": round(max(cli_rps) / max(raw_rps), 3),
        "ratio_median": round(statistics.median(cli_rps) / statistics.median(raw_rps), 3),
        "raw_cpu_us_per_req": round(raw_cpu, 1),
        "client_cpu_us_per_req": round(cli_cpu, 1),
        "cpu_ratio": round(raw_cpu / cli_cpu, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short run (1000 requests, 2 rounds)")
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return
    if args.quick:
        args.requests, args.rounds = min(args.requests, 1000), min(args.rounds, 2)

    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)], env=env)
    try:
        addr = f"127.0.0.1:{port}"
        res = uvloop.run(bench(addr, args.requests, args.concurrency, args.rounds))
    finally:
        server.terminate()
        server.wait(timeout=10)

    print(f"\nagenerate vs raw aiohttp, {res['requests']} requests x {res['rounds']} rounds, "
          f"{res['concurrency']} concurrent, instant server")
    print(f"{'':<22}{'req/s (best)':>14}{'CPU us/req':>12}")
    print(f"{'raw aiohttp loop':<22}{res['raw_rps']:>14.0f}{res['raw_cpu_us_per_req']:>12.0f}")
    print(f"{'SGLangClient':<22}{res['client_rps']:>14.0f}{res['client_cpu_us_per_req']:>12.0f}")
    print(f"{'ratio client/raw':<22}{res['ratio']:>14.3f}{res['cpu_ratio']:>12.3f}   (goal >= 0.8)")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
