"""Controller overhead and memory under back-pressure.

1. Throughput: trajectories/s through ``RolloutController`` + ``RLVRWorkflow``
   (n=1, 1 new token, trivial reward) + ``RemoteSGLangEngine``, against a server
   that answers instantly, vs a raw aiohttp loop posting the same requests to
   the same server with the same concurrency. Goal: ratio >= 0.8.
2. Memory: a consumer 10x slower than the producer over many trajectories;
   RSS at 10%, 50%, 100% of the run must stay flat (back-pressure).

The instant server is this file run with ``--serve PORT`` in a subprocess.

    python benchmarks/bench_controller.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT_LEN = 200  # tokens; large enough that unbounded queues would show in RSS


# ----------------------------------------------------------- instant server
def serve(port: int) -> None:
    """A minimal SGLang-compatible server: /generate returns one token at once."""
    import uvloop
    from aiohttp import web

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        tok = (len(body["input_ids"]) * 7) % 500 + 5
        return web.json_response({
            "output_ids": [tok],
            "meta_info": {
                "id": body.get("rid", ""), "finish_reason": {"type": "length", "length": 1},
                "prompt_tokens": len(body["input_ids"]), "completion_tokens": 1,
                "output_token_logprobs": [[-0.5, tok, None]], "weight_version": "0",
            },
        })

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def info(_: web.Request) -> web.Response:
        return web.json_response({"version": "0.5.23", "engine": "bench-instant", "tp_size": 1})

    app = web.Application()
    app.add_routes([web.post("/generate", generate), web.get("/health", health),
                    web.get("/get_server_info", info)])
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def start_server() -> tuple[subprocess.Popen, str]:
    from tests.conftest import free_port  # noqa: PLC0415  (repo root is on sys.path)

    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port)], start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("instant server did not start")


# ----------------------------------------------------------------- helpers
def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def trivial_reward(*_a, **_k) -> float:
    return 1.0


def make_items(n: int) -> list[dict]:
    return [{"input_ids": [1 + (i + j) % 400 for j in range(PROMPT_LEN)], "answer": 1} for i in range(n)]


# -------------------------------------------------------------- baselines
async def raw_loop(url: str, items: list[dict], concurrency: int) -> tuple[float, float]:
    """(wall s, CPU s) of C workers posting the same /generate requests with plain aiohttp.

    As lean as a client can be and still speak the protocol: one session,
    orjson both ways, a fresh request id per request, one check on the answer.
    """
    import uuid

    import aiohttp

    from arealite.api.types import SamplingParams
    from arealite.engine.sglang_remote import _dumps, _loads

    sp = SamplingParams(max_new_tokens=1).to_sglang()
    headers = {"Content-Type": "application/json"}
    todo = iter(items)

    async def worker(session: aiohttp.ClientSession) -> None:
        for it in todo:
            body = _dumps({"input_ids": it["input_ids"], "sampling_params": sp, "return_logprob": True,
                           "rid": uuid.uuid4().hex})
            async with session.post(url + "/generate", data=body, headers=headers) as r:
                data = _loads(await r.read())
            assert data["output_ids"]

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return time.perf_counter() - t0, time.process_time() - c0


def controller_run(url: str, items: list[dict], concurrency: int, tokenizer, consumer_delay_s: float = 0.0,
                   queue_size: int = 4096, batch: int = 64, progress=None) -> dict:
    """Drive ``items`` through controller + RLVRWorkflow with prepare_batch; return figures."""
    from arealite.config.schema import GenerationConfig, RolloutConfig
    from arealite.data.dataset import StatefulDataLoader
    from arealite.engine.sglang_remote import RemoteSGLangEngine
    from arealite.rollout.controller import RolloutController
    from arealite.workflow.rlvr import RLVRWorkflow

    rc = RolloutConfig(max_concurrent_rollouts=concurrency, consumer_batch_size=batch, queue_size=queue_size,
                       max_head_offpolicyness=10**6, reward_workers=8)
    wf = RLVRWorkflow(trivial_reward, GenerationConfig(n_samples=1, max_new_tokens=1), tokenizer, rc)
    loader = StatefulDataLoader(items, batch_size=batch, shuffle=False)
    steps = len(items) // batch
    ctl = RolloutController(RemoteSGLangEngine([url], rc), rc).start(init_timeout=30)
    max_depth = 0
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        for step in range(steps):
            out = ctl.prepare_batch(loader, wf)
            assert out.batch_size[0] == batch
            ctl.set_version(step + 1)
            if progress is not None:
                progress(step + 1, steps, ctl)
            if consumer_delay_s:
                st = ctl.stats()
                max_depth = max(max_depth, st["output_queue"] + st["running"] + st["input_queue"])
                time.sleep(consumer_delay_s)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        stats = ctl.stats()
    finally:
        ctl.stop()
    return {"traj_per_s": steps * batch / elapsed, "elapsed_s": elapsed, "cpu_s": cpu, "max_depth": max_depth,
            "failed": stats["failed"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short run (CI smoke)")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", type=int, default=64)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return

    import uvloop
    from transformers import AutoTokenizer

    from arealite.models.tiny import build_tiny_model

    n_tp = 2048 if args.quick else 8192
    rounds = 3 if args.quick else 5
    n_mem = 1280 if args.quick else 10240
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tempfile.mkdtemp(), size="micro", seed=0))
    proc, url = start_server()
    try:
        warm = make_items(512)  # warm-up, not timed: imports, first connections, allocator
        controller_run(url, warm, args.concurrency, tokenizer)
        uvloop.run(raw_loop(url, warm, args.concurrency))
        items = make_items(n_tp)
        raw, ctl = [], []  # per round: (traj/s, client CPU us per trajectory)

        def run_raw() -> None:
            wall, cpu = uvloop.run(raw_loop(url, items, args.concurrency))
            raw.append((n_tp / wall, cpu / n_tp * 1e6))

        def run_ctl() -> None:
            r = controller_run(url, items, args.concurrency, tokenizer)
            ctl.append((r["traj_per_s"], r["cpu_s"] / n_tp * 1e6))

        # Interleaved rounds, alternating which side goes first, so that load
        # from other processes on a shared machine hits both sides alike.
        for i in range(rounds):
            for fn in ((run_raw, run_ctl) if i % 2 == 0 else (run_ctl, run_raw)):
                fn()
        raw_tps = statistics.median(r[0] for r in raw)
        ctl_tps = statistics.median(c[0] for c in ctl)
        ratio = statistics.median(c[0] / r[0] for r, c in zip(raw, ctl))  # paired per round
        raw_cpu = statistics.median(r[1] for r in raw)
        ctl_cpu = statistics.median(c[1] for c in ctl)

        # Memory: producer runs at ctl_tps; the consumer takes 10x as long per batch.
        batch = 64
        delay = 10 * batch / ctl_tps
        marks: dict[str, float] = {}
        start_rss = rss_mb()

        def progress(step: int, steps: int, _ctl) -> None:
            for pct in (10, 50, 100):
                if step == max(1, steps * pct // 100) and f"rss_{pct}pct_mb" not in marks:
                    marks[f"rss_{pct}pct_mb"] = rss_mb()

        mem = controller_run(url, make_items(n_mem), args.concurrency, tokenizer, consumer_delay_s=delay,
                             queue_size=256, batch=batch, progress=progress)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    finally:
        proc.terminate()
        proc.wait(10)

    growth = marks["rss_100pct_mb"] - marks["rss_10pct_mb"]
    print(f"\nController throughput (n=1, 1 new token, instant server, concurrency {args.concurrency}, "
          f"{n_tp} trajectories, median of {rounds} interleaved rounds)")
    print(f"{'path':<34}{'traj/s':>10}{'us/traj':>10}{'client CPU us/traj':>20}")
    print(f"{'raw aiohttp loop (baseline)':<34}{raw_tps:>10.0f}{1e6 / raw_tps:>10.0f}{raw_cpu:>20.0f}")
    print(f"{'controller + RLVRWorkflow':<34}{ctl_tps:>10.0f}{1e6 / ctl_tps:>10.0f}{ctl_cpu:>20.0f}")
    print(f"{'ratio (goal >= 0.8)':<34}{ratio:>10.2f}")
    print("rounds (raw, controller traj/s): " + ", ".join(f"({r[0]:.0f}, {c[0]:.0f})" for r, c in zip(raw, ctl)))
    print(f"\nMemory, consumer 10x slower ({n_mem} trajectories, queue_size 256, {delay*1000:.0f} ms per step)")
    print(f"{'point':<34}{'RSS MB':>10}")
    print(f"{'before':<34}{start_rss:>10.1f}")
    for pct in (10, 50, 100):
        print(f"{f'{pct}% consumed':<34}{marks[f'rss_{pct}pct_mb']:>10.1f}")
    print(f"{'growth 10% -> 100%':<34}{growth:>10.1f}")
    print(f"{'max queued+running groups':<34}{mem['max_depth']:>10}")
    print(f"{'peak RSS (ru_maxrss)':<34}{peak:>10.1f}")
    print(json.dumps({
        "raw_traj_per_s": round(raw_tps, 1), "controller_traj_per_s": round(ctl_tps, 1),
        "ratio": round(ratio, 3), "goal_ratio": 0.8, "n_throughput": n_tp, "rounds": rounds,
        "concurrency": args.concurrency, "raw_us_per_traj": round(1e6 / raw_tps, 1),
        "controller_us_per_traj": round(1e6 / ctl_tps, 1), "raw_cpu_us_per_traj": round(raw_cpu, 1),
        "controller_cpu_us_per_traj": round(ctl_cpu, 1),
        "n_memory": n_mem, "rss_10pct_mb": round(marks["rss_10pct_mb"], 1),
        "rss_50pct_mb": round(marks["rss_50pct_mb"], 1), "rss_100pct_mb": round(marks["rss_100pct_mb"], 1),
        "rss_growth_mb": round(growth, 1), "peak_rss_mb": round(peak, 1), "max_depth": mem["max_depth"],
        "consumer_delay_ms": round(delay * 1000, 1), "failed": mem["failed"],
    }))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
