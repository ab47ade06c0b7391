"""CPU cost per trajectory of the rollout hot path, HTTP excluded.

An in-process fake engine answers ``agenerate`` at once (1 token), so what is
left is everything the controller's event loop does per trajectory besides the
HTTP client: ``RLVRWorkflow.arun_episode`` (prompt decode, request building,
reward thread hop, tensor building), validation and the controller's
admit/run/take bookkeeping. Baseline: a "bare" workflow that only awaits
``agenerate`` and returns a pre-built TensorDict (the controller's floor).

CPU time, not wall time, so that the figures hold on a loaded machine:
loop-thread CPU (``time.thread_time()`` read inside the loop thread) and
whole-process CPU (includes reward worker threads and the trainer thread).

    python benchmarks/bench_workflow_cpu.py [--quick] [--profile out.prof]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT_LEN = 200


def make_items(n: int) -> list[dict]:
    return [{"input_ids": [1 + (i + j) % 400 for j in range(PROMPT_LEN)], "answer": 1} for i in range(n)]


def trivial_reward(*_a, **_k) -> float:
    return 1.0


class InstantEngine:
    """``agenerate`` returns a one-token Completion at once (no I/O)."""

    def __init__(self) -> None:
        self.version = 0

    async def agenerate(self, req):
        from arealite.api.types import Completion

        tok = (len(req.input_ids) * 7) % 500 + 5
        return Completion(rid=req.rid, input_ids=req.input_ids, output_ids=[tok], output_logprobs=[-0.5],
                          output_versions=[self.version], finish_reason="length")


class BareWorkflow:
    """The floor: await agenerate, return a pre-built group."""

    def __init__(self) -> None:
        from arealite.api.types import GenerationRequest, SamplingParams
        from arealite.workflow.base import group_from_outputs

        import torch

        self._req = GenerationRequest(input_ids=make_items(1)[0]["input_ids"], sampling=SamplingParams(max_new_tokens=1))
        self._td = group_from_outputs(self._req.input_ids, [([5], [-0.5], [0])], {
            "rewards": torch.ones(1), "group_id": torch.zeros(1, dtype=torch.int64),
            "prompt_id": torch.full((1,), -1, dtype=torch.int64)})

    async def arun_episode(self, client, item):
        await client.agenerate(self._req)
        return self._td

    def stats(self) -> dict:
        return {}


def loop_thread_time(ctl) -> float:
    """``time.thread_time()`` of the controller's loop thread, read on that thread."""
    out: list[float] = []
    ev = threading.Event()

    def _read() -> None:
        out.append(time.thread_time())
        ev.set()

    ctl._loop.call_soon_threadsafe(_read)
    ev.wait(30)
    return out[0]


def run_once(make_workflow, n_items: int, batch: int, concurrency: int, profile: str | None = None) -> dict:
    """Drive ``n_items`` through prepare_batch; return CPU figures per trajectory."""
    from arealite.config.schema import RolloutConfig
    from arealite.data.dataset import StatefulDataLoader
    from arealite.rollout.controller import RolloutController

    rc = RolloutConfig(max_concurrent_rollouts=concurrency, consumer_batch_size=batch, queue_size=4096,
                       max_head_offpolicyness=10**6, reward_workers=8)
    wf = make_workflow(rc)
    loader = StatefulDataLoader(make_items(n_items), batch_size=batch, shuffle=False)
    steps = n_items // batch
    ctl = RolloutController(InstantEngine(), rc).start(init_timeout=30)
    gc_time = [0.0]
    gc_count = [0, 0, 0]
    gc_t0 = [0.0]

    def _gc_cb(phase: str, info: dict) -> None:
        if phase == "start":
            gc_t0[0] = time.perf_counter()
        else:
            gc_time[0] += time.perf_counter() - gc_t0[0]
            gc_count[info["generation"]] += 1

    prof = None
    try:
        # Warm-up batch: first-use costs (imports, allocator, thread start) are not per-trajectory.
        ctl.prepare_batch(loader, wf)
        ctl.set_version(1)
        if profile:
            import cProfile

            prof = cProfile.Profile(time.thread_time)  # CPU, not wall: GIL waits are not costs
            ctl._call(prof.enable)  # cProfile hooks only the thread it is enabled on
        gc.callbacks.append(_gc_cb)
        lt0, pt0, w0 = loop_thread_time(ctl), time.process_time(), time.perf_counter()
        for step in range(1, steps):
            out = ctl.prepare_batch(loader, wf)
            assert out.batch_size[0] == batch
            ctl.set_version(step + 1)
        lt1, pt1, w1 = loop_thread_time(ctl), time.process_time(), time.perf_counter()
        gc.callbacks.remove(_gc_cb)
        if prof is not None:
            ctl._call(prof.disable)
            prof.dump_stats(profile)
        failed = ctl.stats()["failed"]
    finally:
        if _gc_cb in gc.callbacks:
            gc.callbacks.remove(_gc_cb)
        ctl.stop()
    n = (steps - 1) * batch
    assert failed == 0, f"{failed} episodes failed"
    return {"loop_us": (lt1 - lt0) / n * 1e6, "proc_us": (pt1 - pt0) / n * 1e6, "wall_us": (w1 - w0) / n * 1e6,
            "gc_us": gc_time[0] / n * 1e6, "gc0": gc_count[0] / n, "gc1": gc_count[1] / n, "gc2": gc_count[2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short run (CI smoke)")
    ap.add_argument("--profile", help="write a cProfile of the loop thread (RLVR run) to this file")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from arealite.config.schema import GenerationConfig
    from arealite.models.tiny import build_tiny_model
    from arealite.workflow.rlvr import RLVRWorkflow

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tempfile.mkdtemp(), size="micro", seed=0))
    n_items = 2048 if args.quick else 8192
    rounds = 3 if args.quick else 5

    def rlvr(rc):
        return RLVRWorkflow(trivial_reward, GenerationConfig(n_samples=1, max_new_tokens=1), tokenizer, rc)

    def bare(_rc):
        return BareWorkflow()

    run_once(rlvr, 4 * args.batch, args.batch, args.concurrency)  # warm-up of the whole process
    res: dict[str, list[dict]] = {"bare": [], "rlvr": []}
    # Interleaved rounds so that background load hits both alike.
    for i in range(rounds):
        for name, mk in ((("bare", bare), ("rlvr", rlvr)) if i % 2 == 0 else (("rlvr", rlvr), ("bare", bare))):
            res[name].append(run_once(mk, n_items, args.batch, args.concurrency))
    if args.profile:
        run_once(rlvr, n_items, args.batch, args.concurrency, profile=args.profile)

    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in res.items()}
    print(f"\nRollout hot-path CPU per trajectory (instant in-process engine, n=1, {PROMPT_LEN}-token prompts, "
          f"batch {args.batch}, concurrency {args.concurrency}, {n_items} trajectories, median of {rounds} rounds)")
    print(f"{'workflow':<30}{'loop CPU us':>13}{'process CPU us':>16}{'wall us':>10}{'GC us':>8}"
          f"{'GC0/traj':>10}{'GC1/traj':>10}{'gen2 GCs':>10}")
    for name, label in (("bare", "bare (floor)"), ("rlvr", "RLVRWorkflow")):
        m = med[name]
        print(f"{label:<30}{m['loop_us']:>13.1f}{m['proc_us']:>16.1f}{m['wall_us']:>10.1f}{m['gc_us']:>8.1f}"
              f"{m['gc0']:>10.3f}{m['gc1']:>10.3f}{m['gc2']:>10.0f}")
    over_loop = med["rlvr"]["loop_us"] - med["bare"]["loop_us"]
    over_proc = med["rlvr"]["proc_us"] - med["bare"]["proc_us"]
    print(f"{'RLVR minus floor':<30}{over_loop:>13.1f}{over_proc:>16.1f}")
    print(json.dumps({
        "n": n_items, "rounds": rounds, "batch": args.batch, "concurrency": args.concurrency,
        "bare_loop_cpu_us_per_traj": round(med["bare"]["loop_us"], 1),
        "bare_process_cpu_us_per_traj": round(med["bare"]["proc_us"], 1),
        "rlvr_loop_cpu_us_per_traj": round(med["rlvr"]["loop_us"], 1),
        "rlvr_process_cpu_us_per_traj": round(med["rlvr"]["proc_us"], 1),
        "rlvr_over_bare_loop_us": round(over_loop, 1), "rlvr_over_bare_process_us": round(over_proc, 1),
        "rlvr_gc_us_per_traj": round(med["rlvr"]["gc_us"], 1), "bare_gc_us_per_traj": round(med["bare"]["gc_us"], 1),
    }))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
