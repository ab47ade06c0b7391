"""Where the controller's CPU per trajectory goes: direct accounting, not sampling.

bench_controller's throughput path (``RolloutController`` + ``RLVRWorkflow``, n=1, 1 new token,
trivial reward, ``SGLangClient`` against the instant server), run in this process, measured
three ways, each per trajectory:

1. **Per thread** (clean runs, nothing wrapped): every thread's CPU from
   ``/proc/self/task/*/schedstat`` (ns on CPU) and its context switches, grouped as the
   event-loop thread, the trainer thread (the caller of ``prepare_batch``), the reward
   workers and the rest; the raw aiohttp loop beside it for reference.
2. **Per stage** (instrumented runs): each stage's own thread CPU (``time.thread_time_ns``)
   summed over the run. Plain functions are wrapped; coroutines (an episode, the workflow,
   the client's ``agenerate``, the reward call's loop side) are driven step by step by a
   wrapper that times each step, so time spent in other tasks between two steps is not
   counted. Stages nest: an episode holds its workflow, which holds the client.
3. **Alone**: each per-trajectory piece in a tight loop (10,000 calls).

    python benchmarks/controller_costs.py [--n 8192] [--rounds 3] [--switch-ms 0.5]

Prints tables; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_controller as bc  # noqa: E402

# ------------------------------------------------------------------ per-thread clocks


def thread_clocks() -> dict[int, tuple[int, int]]:
    """{tid: (ns on CPU, context switches)} of every thread of this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/status") as f:
                sw = sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (ns, sw)
    return out


def thread_roles(trainer_tid: int) -> dict[int, str]:
    """{tid: role} of the Python threads alive now (call before they end)."""
    roles = {"arealite-rollout": "event-loop thread", "arealite-reward": "reward workers",
             "raw-loop": "event-loop thread"}
    out = {t.native_id: roles.get(t.name, f"other python ({t.name})") for t in threading.enumerate()}
    out[trainer_tid] = "trainer thread (prepare_batch)"
    return out


def per_thread(before: dict, after: dict, roles: dict[int, str], n: int) -> dict[str, tuple[float, float]]:
    """{role: (CPU us per trajectory, switches per trajectory)}."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for tid, (ns, sw) in after.items():
        ns0, sw0 = before.get(tid, (0, 0))
        role = roles.get(tid, "other (native)")
        acc[role][0] += (ns - ns0) / 1e3 / n
        acc[role][1] += (sw - sw0) / n
    return {k: (v[0], v[1]) for k, v in acc.items()}


# ------------------------------------------------------------------ stage accounting
ACC: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # name -> [ns, calls]
# The thread's own CPU clock. Elapsed time (perf_counter) would be cheaper to read but counts
# the GIL waits inside a step (the loop thread loses the GIL to a reward worker mid-step): it
# read 4x the CPU. The thread clock is a system call here (~2 us); `calibrate` measures what
# a wrapper adds to its own figure and to its parent's, and the table subtracts both.
_now = time.thread_time_ns


def timed_fn(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = _now()
        try:
            return fn(*a, **k)
        finally:
            e = ACC[name]
            e[0] += _now() - t0
            e[1] += 1
    return wrapper


class _TimedCoro:
    """Drives ``coro`` step by step, adding each step's thread CPU to ``ACC[name]``."""

    __slots__ = ("coro", "name")

    def __init__(self, coro, name):
        self.coro, self.name = coro, name

    def __await__(self):
        coro, e = self.coro, ACC[self.name]
        e[1] += 1
        send, exc = None, None
        while True:
            t0 = _now()
            try:
                y = coro.throw(exc) if exc is not None else coro.send(send)
            except StopIteration as stop:
                e[0] += _now() - t0
                return stop.value
            except BaseException:
                e[0] += _now() - t0
                raise
            e[0] += _now() - t0
            try:
                send, exc = (yield y), None
            except BaseException as ex:  # noqa: BLE001  (thrown into the inner coroutine)
                send, exc = None, ex


def timed_coro(name: str, fn):
    @functools.wraps(fn)
    async def wrapper(*a, **k):
        return await _TimedCoro(fn(*a, **k), name)
    return wrapper


def calibrate() -> tuple[float, float]:
    """(ns a wrapped call adds to its own figure, ns it adds to its parent's)."""
    ACC.clear()
    f = timed_fn("x", lambda: None)
    g = lambda: None  # noqa: E731
    n = 20000
    t0 = _now()
    for _ in range(n):
        f()
    wrapped = (_now() - t0) / n
    t0 = _now()
    for _ in range(n):
        g()
    plain = (_now() - t0) / n
    own = ACC["x"][0] / ACC["x"][1]
    ACC.clear()
    return own, wrapped - plain


NESTED: dict[str, set[str]] = {}  # stage -> the stages inside it
ORDER: list[str] = []
DEPTH: dict[str, int] = {}


def corrected(acc: dict, own: float, to_parent: float, n: int) -> dict[str, tuple[float, float]]:
    """{stage: (us, calls) per trajectory}, less the wrappers' own cost and their children's."""
    out = {}
    for name, (ns, calls) in acc.items():
        kids = sum(c for other, (_, c) in acc.items() if other in NESTED.get(name, ()))
        out[name] = ((ns - calls * own - kids * to_parent) / 1e3 / n, calls / n)
    return out


def instrument() -> list[tuple[object, str, object]]:
    """Wrap the stages; returns what to put back."""
    from arealite.inference_client import http1, remote_client, sglang_wire
    from arealite.reward import pool
    from arealite.rollout import admission, feed, ready
    from arealite.workflow import common, rlvr

    E, W, C = "episode (Admission._run, all of it)", "workflow (RLVRWorkflow._group)", "client (agenerate)"
    P = "batch coroutine (DataFeed.prepare)"
    plan = [  # (owner, attribute, stage name, coroutine?, parent)
        (admission.Admission, "_run", E, True, None),
        (rlvr.RLVRWorkflow, "_group", W, True, E),
        (remote_client.RemoteInferenceClient, "agenerate", C, True, W),
        (pool.RewardRunner, "__call__", "reward call, loop side", True, W),
        (common, "encode_prompt", "prompt decode (encode_prompt)", False, W),
        (rlvr, "decode", "answer decode", False, W),
        (rlvr, "item_fields", "item_fields", False, W),
        (rlvr, "GroupBuffers", "group buffers (GroupBuffers)", False, W),
        (rlvr, "routed_experts_of", "routed_experts_of", False, W),
        (rlvr, "GenerationRequest", "GenerationRequest", False, W),
        (remote_client, "encode_request", "request body (orjson)", False, C),
        (sglang_wire.SGLangWire, "parse_generate", "answer parse", False, C),
        (remote_client, "check_segment", "check_segment", False, C),
        (remote_client.RemoteInferenceClient, "_complete", "Completion", False, C),
        (admission, "validate_trajectory", "validate_trajectory", False, E),
        (admission.Admission, "_end_running", "Admission._end_running", False, E),
        (ready.ReadyGroups, "put", "ReadyGroups.put", False, E),
        (admission.Admission, "admit", "Admission.admit (+ task creation)", False, None),
        (feed.DataFeed, "prepare", P, True, None),
        (ready.ReadyGroups, "take", "ReadyGroups.take (the batch's tensors)", False, P),
        (feed.DataFeed, "top_up", "DataFeed.top_up", False, P),
        (feed.DataFeed, "_overdue_running", "DataFeed._overdue_running", False, P),
        (http1._Conn, "data_received", "HTTP data_received (loop callback)", False, None),
        (pool.RewardRunner, "_drain", "reward results drain (loop callback)", False, None),
    ]
    parent = {name: par for *_, name, _, par in plan}
    NESTED.clear()
    for name in parent:
        p = parent[name]
        while p is not None:
            NESTED.setdefault(p, set()).add(name)
            p = parent[p]
    ORDER[:] = [name for *_, name, _, _ in plan]
    DEPTH.clear()
    for name in parent:
        d, p = 0, parent[name]
        while p is not None:
            d, p = d + 1, parent[p]
        DEPTH[name] = d
    undo = []
    for owner, attr, name, is_coro, _ in plan:
        orig = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        undo.append((owner, attr, orig))
        setattr(owner, attr, (timed_coro if is_coro else timed_fn)(name, orig))
    return undo


def uninstrument(undo) -> None:
    for owner, attr, orig in undo:
        setattr(owner, attr, orig)


# ------------------------------------------------------------------ runs
def run_controller(url, items, tokenizer, conc, switch_ms, queue_size=4096) -> dict:
    """One bench_controller throughput run, with per-thread clocks around the timed part."""
    from arealite.config.schema import GenerationConfig, RolloutConfig
    from arealite.data.dataset import StatefulDataLoader
    from arealite.inference_client.sglang_client import SGLangClient
    from arealite.rollout.controller import RolloutController
    from arealite.workflow.rlvr import RLVRWorkflow

    batch = 64
    rc = RolloutConfig(max_concurrent_rollouts=conc, consumer_batch_size=batch, queue_size=queue_size,
                       max_head_offpolicyness=10**6, reward_workers=8, gil_switch_interval_ms=switch_ms)
    wf = RLVRWorkflow(bc.trivial_reward, GenerationConfig(n_samples=1, max_new_tokens=1), tokenizer, rc)
    loader = StatefulDataLoader(items, batch_size=batch, shuffle=False)
    ctl = RolloutController(SGLangClient([url], rc), rc).start(init_timeout=30)
    try:
        ctl.prepare_batch(loader, wf)  # reward workers and connections up
        ctl.set_version(1)
        steps = len(items) // batch - 1
        c0, t0, w0 = thread_clocks(), time.process_time(), time.perf_counter()
        for step in range(steps):
            ctl.prepare_batch(loader, wf)
            ctl.set_version(step + 2)
        wall, cpu, c1 = time.perf_counter() - w0, time.process_time() - t0, thread_clocks()
        roles = thread_roles(threading.get_native_id())
    finally:
        ctl.stop()
    n = steps * batch
    return {"n": n, "us": cpu / n * 1e6, "tps": n / wall,
            "threads": per_thread(c0, c1, roles, n)}


def run_raw(url, items, conc) -> dict:
    box = {}

    def _in_thread():
        box["tid"] = threading.get_native_id()
        box["c0"] = thread_clocks()
        box["res"] = uvloop.run(bc.raw_loop(url, items, conc))
        box["c1"] = thread_clocks()
        box["roles"] = thread_roles(-1)

    t = threading.Thread(target=_in_thread, name="raw-loop")
    t.start()
    t.join()
    wall, cpu = box["res"]
    n = len(items)
    th = per_thread(box["c0"], box["c1"], box["roles"], n)
    return {"n": n, "us": cpu / n * 1e6, "tps": n / wall, "threads": th}


def alone(tokenizer) -> dict[str, float]:
    """Each per-trajectory piece alone, 10,000 calls: us per call."""
    import uuid

    import torch

    from arealite.api.types import validate_trajectory
    from arealite.rollout.ready import ReadyGroups
    from arealite.utils.tokenizer import decode, prepare_decode
    from arealite.workflow.base import group_from_outputs, new_group_id
    from arealite.workflow.common import encode_prompt
    from array import array

    prepare_decode(tokenizer)
    item = bc.make_items(1)[0]
    ids = item["input_ids"]
    comp = ([17], [-0.5], [0])
    per_row = lambda: {"rewards": torch.frombuffer(array("f", [1.0]), dtype=torch.float32),  # noqa: E731
                       "group_id": torch.frombuffer(array("q", [1]), dtype=torch.int64)}
    td = group_from_outputs(ids, [comp], per_row())
    N = 10_000

    def t(fn) -> float:
        for _ in range(200):
            fn()
        t0 = time.thread_time_ns()
        for _ in range(N):
            fn()
        return (time.thread_time_ns() - t0) / N / 1e3

    rg = ReadyGroups()

    def put_take():
        for _ in range(64):
            rg.put(td, item)
        rg.take(64, 0)

    return {
        "prompt decode (200 tokens)": t(lambda: encode_prompt(tokenizer, item, "prompt", False)),
        "answer decode (1 token)": t(lambda: decode(tokenizer, [17])),
        "trajectory TensorDict (1 row)": t(lambda: group_from_outputs(ids, [comp], per_row())),
        "validate_trajectory (vouched)": t(lambda: validate_trajectory(td, where="x")),
        "uuid4().hex": t(lambda: uuid.uuid4().hex),
        "group id + request id": t(lambda: f"ab-{new_group_id():x}-0"),
        "ReadyGroups put + take, per group (64)": t(put_take) / 64,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--queue-size", type=int, default=4096,
                    help="rollout.queue_size (bench_controller's 4,096 lets the producer run far ahead)")
    ap.add_argument("--reward-inline", action="store_true",
                    help="declare the trivial reward cheap (`cheap_reward`: scored on the loop, no thread hop)")
    ap.add_argument("--switch-ms", type=float, default=0.5, help="rollout.gil_switch_interval_ms (0: unchanged)")
    args = ap.parse_args()
    switch = args.switch_ms or None
    if args.reward_inline:
        from arealite.reward.pool import cheap_reward

        cheap_reward(bc.trivial_reward)

    from transformers import AutoTokenizer

    from arealite.models.tiny import build_tiny_model

    tok = AutoTokenizer.from_pretrained(build_tiny_model(tempfile.mkdtemp(), size="micro", seed=0))
    proc, url = bc.start_server()
    items = bc.make_items(args.n + 64)
    clean, raw, inst = [], [], []
    cal, cal_parent = calibrate()
    try:
        run_controller(url, bc.make_items(1024), tok, args.concurrency, switch)  # warm-up
        run_raw(url, bc.make_items(512), args.concurrency)
        for r in range(args.rounds):
            order = (0, 1, 2) if r % 2 == 0 else (2, 1, 0)
            for which in order:
                if which == 0:
                    raw.append(run_raw(url, items[: args.n], args.concurrency))
                elif which == 1:
                    clean.append(run_controller(url, items, tok, args.concurrency, switch, args.queue_size))
                else:
                    ACC.clear()
                    undo = instrument()
                    try:
                        res = run_controller(url, items, tok, args.concurrency, switch, args.queue_size)
                    finally:
                        uninstrument(undo)
                    # The instrumented run includes the untimed first batch: per trajectory of all.
                    res["stages"] = corrected(dict(ACC), cal, cal_parent, res["n"] + 64)
                    inst.append(res)
        solo = alone(tok)
    finally:
        proc.terminate()
        proc.wait(10)

    med = statistics.median
    print(f"\nPer thread, CPU us (context switches) per trajectory, median of {args.rounds} rounds "
          f"of {args.n}; GIL switch interval {switch} ms; load {open('/proc/loadavg').read().split()[:3]}")
    roles = sorted({k for r in clean + raw for k in r["threads"]})
    print(f"{'thread':<34}{'controller':>18}{'raw loop':>18}")
    threads_json = {}
    for role in roles:
        c = [r["threads"].get(role, (0, 0)) for r in clean]
        w = [r["threads"].get(role, (0, 0)) for r in raw]
        cu, cs, wu, ws = med(x[0] for x in c), med(x[1] for x in c), med(x[0] for x in w), med(x[1] for x in w)
        threads_json[role] = {"controller_us": round(cu, 1), "controller_switches": round(cs, 2),
                              "raw_us": round(wu, 1), "raw_switches": round(ws, 2)}
        print(f"{role:<34}{cu:>10.1f} ({cs:4.2f}){wu:>10.1f} ({ws:4.2f})")
    cu, wu = med(r["us"] for r in clean), med(r["us"] for r in raw)
    print(f"{'process CPU':<34}{cu:>10.1f}       {wu:>10.1f}  (rounds: controller "
          f"{min(r['us'] for r in clean):.0f}-{max(r['us'] for r in clean):.0f}, raw "
          f"{min(r['us'] for r in raw):.0f}-{max(r['us'] for r in raw):.0f})")
    tps_ratio = med(c["tps"] / r["tps"] for c, r in zip(clean, raw))
    print(f"throughput ratio {tps_ratio:.2f}, CPU ratio {wu / cu:.2f}; instrumented run: {med(r['us'] for r in inst):.0f} us")

    print(f"\nPer stage (instrumented runs; us per trajectory of each step on its thread, less {cal:.0f} ns per "
          f"call for the clock and {cal_parent:.0f} ns per call inside a parent; calls per trajectory; nested by indent: a parent includes its children and their "
          "wrappers)")
    stages = {}
    for name in ORDER:
        us = med(r["stages"].get(name, (0, 0))[0] for r in inst)
        calls = med(r["stages"].get(name, (0, 0))[1] for r in inst)
        stages[name] = {"us": round(us, 2), "calls": round(calls, 2)}
        print(f"{'  ' * DEPTH[name] + name:<52}{us:>8.1f}{calls:>8.2f}")
    print("\nAlone (10,000 calls each, us per call)")
    for k, v in solo.items():
        print(f"{k:<48}{v:>8.2f}")
    print(json.dumps({"controller_cpu_us": round(cu, 1), "raw_cpu_us": round(wu, 1), "cpu_ratio": round(wu / cu, 3),
                      "ratio": round(tps_ratio, 3), "threads": threads_json, "stages": stages,
                      "alone_us": {k: round(v, 2) for k, v in solo.items()}, "switch_ms": switch,
                      "n": args.n, "rounds": args.rounds}))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
