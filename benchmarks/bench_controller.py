"""Controller overhead and memory under back-pressure.

1. Throughput: trajectories/s through ``RolloutController`` + ``RLVRWorkflow``
   (n=1, 1 new token, trivial reward) + ``SGLangClient``, against a server
   that answers instantly, vs a raw aiohttp loop posting the same requests to
   the same server with the same concurrency. Goal: ratio >= 0.85 (issue 31). The raw
   loop is a floor for the HTTP path only: it neither decodes nor scores nor builds tensors.
2. Memory: 10,240 trajectories (1,280 with --quick) through a run whose trainer is
   10x slower than the producer, as in training: staleness bound on (``--eta``), and
   after every batch a weight update (``pause()`` -> ``set_version(v + 1)`` ->
   ``resume()``). RSS at 10%, 50%, 100% of the run and its peak must stay flat
   (back-pressure); a watchdog exits with status 3 and every thread's stack if no
   batch comes for ``--stall-s`` seconds (a deadlock).

The instant server is this file run with ``--serve PORT`` in a subprocess.

    python benchmarks/bench_controller.py [--quick] [--only throughput|memory]
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT_LEN = 200  # tokens; large enough that unbounded queues would show in RSS


# ----------------------------------------------------------- instant server
def serve(port: int) -> None:
    """A minimal SGLang-compatible server: /generate returns one token at once."""
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
    from arealite.inference_client.sglang_client import _dumps, _loads

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


def start_controller(url: str, items: list[dict], concurrency: int, tokenizer, batch: int,
                     queue_size: int = 4096, eta: int = 10**6):
    """A started controller, an RLVRWorkflow (n=1, 1 new token, trivial reward) and a loader over ``items``."""
    from arealite.config.schema import GenerationConfig, RolloutConfig
    from arealite.data.dataset import StatefulDataLoader
    from arealite.inference_client.sglang_client import SGLangClient
    from arealite.rollout.controller import RolloutController
    from arealite.workflow.rlvr import RLVRWorkflow

    rc = RolloutConfig(max_concurrent_rollouts=concurrency, consumer_batch_size=batch, queue_size=queue_size,
                       max_head_offpolicyness=eta, reward_workers=8)
    wf = RLVRWorkflow(trivial_reward, GenerationConfig(n_samples=1, max_new_tokens=1), tokenizer, rc)
    loader = StatefulDataLoader(items, batch_size=batch, shuffle=False)
    ctl = RolloutController(SGLangClient([url], rc), rc).start(init_timeout=30)
    return ctl, wf, loader


def controller_run(url: str, items: list[dict], concurrency: int, tokenizer, batch: int = 64) -> dict:
    """Drive ``items`` through controller + RLVRWorkflow with prepare_batch, as fast as it goes."""
    ctl, wf, loader = start_controller(url, items, concurrency, tokenizer, batch)
    steps = len(items) // batch
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        for step in range(steps):
            out = ctl.prepare_batch(loader, wf)
            assert out.batch_size[0] == batch
            ctl.set_version(step + 1)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        stats = ctl.stats()
    finally:
        ctl.stop()
    return {"traj_per_s": steps * batch / elapsed, "elapsed_s": elapsed, "cpu_s": cpu, "failed": stats["failed"]}


class Watchdog:
    """Ends the process (exit 3) with a message and every thread's stack when ``beat()`` has
    not been called for ``stall_s`` seconds: a deadlock fails loudly instead of hanging."""

    def __init__(self, stall_s: float, where):
        self.stall_s, self.where = stall_s, where
        self.last = time.monotonic()
        self._stopped = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def beat(self) -> None:
        self.last = time.monotonic()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(1.0):
            idle = time.monotonic() - self.last
            if idle > self.stall_s:
                print(f"\nbench_controller: DEADLOCK? no progress for {idle:.0f}s at {self.where()}; "
                      "the stack of every thread follows", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(all_threads=True)
                os._exit(3)


def slow_trainer_run(url: str, items: list[dict], concurrency: int, tokenizer, step_s: float, eta: int,
                     stall_s: float, queue_size: int = 256, batch: int = 64) -> dict:
    """Drive ``items`` through the controller as the training script does, with a slow trainer.

    Staleness bound ``eta`` on. Each step takes a batch, trains (a sleep of 0.9 ``step_s``)
    and updates the weights: ``pause()``, 0.1 ``step_s``, ``set_version(v + 1)``, ``resume()``.
    RSS is sampled after every step; a ``Watchdog`` ends the run if no batch comes for ``stall_s``.
    """
    steps = len(items) // batch
    rss: list[float] = []  # MB, after each step
    max_depth = 0
    watchdog = Watchdog(stall_s, lambda: f"step {len(rss)}/{steps}")
    ctl, wf, loader = start_controller(url, items, concurrency, tokenizer, batch, queue_size=queue_size, eta=eta)
    try:
        t0 = time.perf_counter()
        for step in range(steps):
            out = ctl.prepare_batch(loader, wf)
            watchdog.beat()
            assert out.batch_size[0] == batch
            st = ctl.stats()
            max_depth = max(max_depth, st["output_queue"] + st["running"] + st["input_queue"])
            time.sleep(0.9 * step_s)  # training
            ctl.pause()  # a weight update: no new episode starts until resume()
            time.sleep(0.1 * step_s)
            ctl.set_version(step + 1)
            ctl.resume()
            rss.append(rss_mb())
        elapsed = time.perf_counter() - t0
        stats = ctl.stats()
    finally:
        ctl.stop()
        watchdog.stop()
    return {"elapsed_s": elapsed, "rss_mb": rss, "max_depth": max_depth, "failed": stats["failed"],
            "consumed": stats["consumed"]}


def throughput_phase(url: str, tokenizer, args) -> dict:
    """Controller vs raw aiohttp loop, interleaved rounds; prints its table, returns its figures."""
    n_tp = 2048 if args.quick else 8192
    rounds = 3 if args.quick else 5
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
    ratios = [c[0] / r[0] for r, c in zip(raw, ctl)]  # paired per round
    # The same in CPU time (raw loop's client CPU per trajectory over the controller's): steadier
    # than wall time on a shared machine, where other jobs' load stretches both sides' waits.
    cpu_ratios = [r[1] / c[1] for r, c in zip(raw, ctl)]
    ratio, cpu_ratio = statistics.median(ratios), statistics.median(cpu_ratios)
    raw_cpu = statistics.median(r[1] for r in raw)
    ctl_cpu = statistics.median(c[1] for c in ctl)

    print(f"\nController throughput (n=1, 1 new token, instant server, concurrency {args.concurrency}, "
          f"{n_tp} trajectories, median of {rounds} interleaved rounds)")
    print(f"{'path':<34}{'traj/s':>10}{'us/traj':>10}{'client CPU us/traj':>20}")
    print(f"{'raw aiohttp loop (baseline)':<34}{raw_tps:>10.0f}{1e6 / raw_tps:>10.0f}{raw_cpu:>20.0f}")
    print(f"{'controller + RLVRWorkflow':<34}{ctl_tps:>10.0f}{1e6 / ctl_tps:>10.0f}{ctl_cpu:>20.0f}")
    print(f"{'ratio (goal >= 0.85)':<34}{ratio:>10.2f}   rounds {min(ratios):.2f}-{max(ratios):.2f}")
    print(f"{'CPU ratio (raw CPU / controller)':<34}{cpu_ratio:>10.2f}   rounds {min(cpu_ratios):.2f}-{max(cpu_ratios):.2f}")
    print("rounds (raw, controller traj/s): " + ", ".join(f"({r[0]:.0f}, {c[0]:.0f})" for r, c in zip(raw, ctl)))
    return {
        "raw_traj_per_s": round(raw_tps, 1), "controller_traj_per_s": round(ctl_tps, 1),
        "ratio": round(ratio, 3), "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
        "cpu_ratio": round(cpu_ratio, 3), "cpu_ratio_min": round(min(cpu_ratios), 3),
        "cpu_ratio_max": round(max(cpu_ratios), 3), "goal_ratio": 0.85, "n_throughput": n_tp, "rounds": rounds,
        "concurrency": args.concurrency, "raw_us_per_traj": round(1e6 / raw_tps, 1),
        "controller_us_per_traj": round(1e6 / ctl_tps, 1), "raw_cpu_us_per_traj": round(raw_cpu, 1),
        "controller_cpu_us_per_traj": round(ctl_cpu, 1),
    }


def memory_phase(url: str, tokenizer, args, producer_tps: float) -> dict:
    """A trainer 10x slower than the producer; prints its table, returns its figures."""
    n_mem = 1280 if args.quick else 10240
    batch, queue_size = 64, 256
    step_s = 10 * batch / producer_tps
    before = rss_mb()
    mem = slow_trainer_run(url, make_items(n_mem), args.concurrency, tokenizer, step_s, args.eta, args.stall_s,
                           queue_size=queue_size, batch=batch)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rss = mem["rss_mb"]
    marks = {pct: rss[max(1, len(rss) * pct // 100) - 1] for pct in (10, 50, 100)}
    growth = marks[100] - marks[10]
    peak_sampled = max(rss[len(rss) // 10:])
    bound = (args.eta + 1) * batch  # groups ahead of the trainer the staleness bound allows

    print(f"\nMemory, a trainer 10x slower than the producer ({n_mem} trajectories, {step_s * 1000:.0f} ms per "
          f"step incl. a paused weight update, staleness bound eta={args.eta}, queue_size {queue_size})")
    print(f"{'point':<34}{'RSS MB':>10}")
    print(f"{'before':<34}{before:>10.1f}")
    for pct in (10, 50, 100):
        print(f"{f'{pct}% consumed':<34}{marks[pct]:>10.1f}")
    print(f"{'growth 10% -> 100%':<34}{growth:>10.1f}")
    print(f"{'peak sampled after 10%':<34}{peak_sampled:>10.1f}")
    print(f"{'peak RSS (ru_maxrss, process)':<34}{peak:>10.1f}")
    print(f"{'max queued+running groups':<34}{mem['max_depth']:>10}  (bound (eta+1)*batch = {bound})")
    print(f"{'trajectories consumed / failed':<34}{mem['consumed']:>10} / {mem['failed']}")
    print(f"no deadlock: {len(rss)} steps in {mem['elapsed_s']:.0f}s (watchdog: {args.stall_s:.0f}s without a batch)")
    return {
        "n_memory": n_mem, "eta": args.eta, "rss_before_mb": round(before, 1),
        "rss_10pct_mb": round(marks[10], 1), "rss_50pct_mb": round(marks[50], 1),
        "rss_100pct_mb": round(marks[100], 1), "rss_growth_mb": round(growth, 1),
        "peak_sampled_after_10pct_mb": round(peak_sampled, 1), "peak_rss_mb": round(peak, 1),
        "max_depth": mem["max_depth"], "depth_bound": bound, "consumed": mem["consumed"], "failed": mem["failed"],
        "consumer_delay_ms": round(step_s * 1000, 1), "memory_elapsed_s": round(mem["elapsed_s"], 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short run (CI smoke)")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--only", choices=("throughput", "memory"), help="run one phase only")
    ap.add_argument("--eta", type=int, default=2, help="memory phase: rollout.max_head_offpolicyness")
    ap.add_argument("--stall-s", type=float, default=60.0,
                    help="memory phase: exit 3 (deadlock) when no batch comes for this long")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return

    from transformers import AutoTokenizer

    from arealite.models.tiny import build_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tempfile.mkdtemp(), size="micro", seed=0))
    proc, url = start_server()
    figures: dict = {}
    try:
        warm = make_items(512)  # warm-up, not timed: imports, first connections, allocator
        controller_run(url, warm, args.concurrency, tokenizer)
        uvloop.run(raw_loop(url, warm, args.concurrency))
        if args.only != "memory":
            figures.update(throughput_phase(url, tokenizer, args))
        if args.only != "throughput":
            # The producer's rate sets the slow trainer's pace: this session's controller rate.
            producer_tps = figures.get("controller_traj_per_s") or controller_run(
                url, make_items(2048 if args.quick else 8192), args.concurrency, tokenizer)["traj_per_s"]
            figures.update(memory_phase(url, tokenizer, args, producer_tps))
    finally:
        proc.terminate()
        proc.wait(10)
    print(json.dumps(figures))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
