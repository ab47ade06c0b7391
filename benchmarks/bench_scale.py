"""Cluster scale by simulation: the real controller, client and publisher against N simulated servers.

Part (b), scaling: 8, 32, 128 and 256 simulated GPU servers (``python -m arealite.sim``,
spread over ``--sim-procs`` child processes, one event loop each) at constant work per server:
each server gets ``--per-server`` requests in flight and ``--items`` prompts to answer, through the real
``RolloutController`` + ``RLVRWorkflow`` + ``SGLangClient`` in this process. Reported:

- throughput per server (completed requests / s / server) relative to 8 servers;
- client and controller CPU per completed request (this process's CPU time: the controller's
  loop, the client, the workflows, the trainer-side ``prepare_batch``);
- p99 client wait: from ``agenerate`` being called to the server receiving the request (wall
  clocks of both processes; it includes the simulated servers' own HTTP parsing, so it is an
  upper bound of the time spent in the client before the first byte goes out);
- controller RSS after every batch (at the end, and its growth from a quarter of the run on);
- the admin fan-out alone: pause + continue to every server with nothing in flight (wall and
  this process's CPU, median of ``--admin-rounds``);
- weight updates through the real ``WeightPublisher`` (disk transfer of a tiny model, the
  simulated 7B transfer held on every server), in each pause mode (``--pause-modes``), interleaved
  rounds after a warm-up one: pause -> resume wall time minus the simulated transfer, each phase,
  and the client's CPU on the update's critical path (the publisher's ``held_client_cpu_s``)
  apart from this process's CPU and the servers' (the first pause of a client also asks every
  server whether its start-up warm-up is over, reported apart as ``warm_check_ms``).

Simulated compute runs ``--time-scale`` times real time; orchestration always runs in real time.
The last line is JSON: ``scaling_efficiency_256``, ``cpu_per_request_growth_256``,
``update_client_cpu_ms_256`` and ``update_overhead_ms_256`` (the default mode; ``..._256_<mode>``
for each, median and spread), ``admin_fanout_ms_256``, ``rss_growth_mb_256`` ... Part (a), AReaL's
setup simulated (``eta4_of_bound``), is `scale_overlap.py`; ``--part a`` runs it alone.

    python benchmarks/bench_scale.py [--quick] [--servers 8,32,128,256] [--sim-procs 2] [--profile-update FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_controller import rss_mb  # noqa: E402  (the controller benchmark's RSS reading)
from scale_overlap import add_arguments as add_overlap_arguments  # part (a)
from scale_overlap import run_part_a

PROMPT_LEN = 64


def free_ports(n: int) -> list[int]:
    import socket

    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def start_sim(model_dir: Path, n: int, args, work: Path) -> tuple[list[subprocess.Popen], list[str], list[Path]]:
    """``n`` simulated servers over ``args.sim_procs`` child processes (one event loop each);
    returns the processes, every server's address and each process's trace file."""
    ports = free_ports(n)
    k = max(1, min(args.sim_procs, n))
    procs, traces, addrs = [], [], [f"127.0.0.1:{p}" for p in ports]
    for j in range(k):
        mine = ports[j::k]
        trace, log = work / f"trace{n}_{j}.jsonl", work / f"sim{n}_{j}.log"
        cmd = [sys.executable, "-m", "arealite.sim", "--model-path", str(model_dir),
               "--sim-ports", ",".join(map(str, mine)), "--sim-time-scale", str(args.time_scale),
               "--sim-length-median", str(args.length_median), "--sim-trace", str(trace), "--log-level", "warning",
               "--context-length", "32768"]
        procs.append(subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                      env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True))
        traces.append(trace)
    deadline = time.monotonic() + 300
    for i, a in enumerate(addrs):
        proc = procs[i % k]
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                for other in procs:  # none left behind
                    other.kill()
                log = work / f"sim{n}_{i % k}.log"
                raise RuntimeError(f"simulated servers did not start:\n{log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://{a}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.2)
    return procs, addrs, traces


def timed_client_class():
    """SGLangClient that notes when each request was handed to it (wall clock, by rid)."""
    from arealite.inference_client.sglang_client import SGLangClient

    class TimedClient(SGLangClient):
        sent: dict[str, float] = {}

        async def agenerate(self, req):
            self.sent[req.rid] = time.time()
            return await super().agenerate(req)

    return TimedClient


def run_one(n: int, model_dir: Path, tokenizer, args, work: Path) -> dict:
    from arealite.config.schema import ArealiteConfig, GenerationConfig, RolloutConfig
    from arealite.data.dataset import StatefulDataLoader
    from arealite.rollout.controller import RolloutController
    from arealite.workflow.rlvr import RLVRWorkflow

    procs, addrs, traces = start_sim(model_dir, n, args, work)
    conc, batch = args.per_server * n, max(1, args.per_server * n // 2)
    items = [{"input_ids": [1 + (i + j) % 400 for j in range(PROMPT_LEN)], "answer": 1}
             for i in range(args.items * n)]
    rc = RolloutConfig(max_concurrent_rollouts=conc, consumer_batch_size=batch, queue_size=max(4096, conc),
                       max_head_offpolicyness=10**6, reward_workers=4)
    wf = RLVRWorkflow(lambda *a, **k: 1.0, GenerationConfig(n_samples=1, max_new_tokens=args.max_new_tokens),
                      tokenizer, rc)
    client = timed_client_class()(addrs, rc)
    ctl = RolloutController(client, rc).start(init_timeout=120)
    try:
        fanout = admin_rounds(ctl, client, args.admin_rounds)
        steps = len(items) // batch
        loader = StatefulDataLoader(items, batch_size=batch, shuffle=False)
        rss_steps = []  # RSS after each batch: flat in the number of completed requests?
        t0, c0 = time.perf_counter(), time.process_time()
        for step in range(steps):
            ctl.prepare_batch(loader, wf)
            rss_steps.append(rss_mb())
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        done = steps * batch
        rss = rss_steps[-1]
        update = weight_update(ctl, client, model_dir, args, work)
    finally:
        ctl.stop()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)
    waits = client_waits(client.sent, traces)
    return {"n": n, "done": done, "wall_s": wall, "per_server_rps": done / wall / n,
            "cpu_us_per_req": cpu / done * 1e6, "p99_wait_ms": float(np.percentile(waits, 99)) * 1e3,
            "rss_mb": rss, "rss_quarter_mb": rss_steps[(len(rss_steps) - 1) // 4], "rss_steps_mb": rss_steps,
            **fanout, **update}


def admin_rounds(ctl, client, rounds: int) -> dict:
    """The client's admin fan-out alone: pause (abort mode) then continue to every server with
    nothing in flight, ``rounds`` times after one warm-up round (the first pause also asks
    every server whether its start-up warm-up is over: ``warm_check_ms``, that round's wall).
    Wall ms per round and this process's CPU ms per round: medians, with the spread (min-max)."""
    async def one() -> None:
        await client.admin.pause_generation()
        await client.admin.continue_generation()

    t0 = time.perf_counter()
    ctl.run(one())
    first = (time.perf_counter() - t0) * 1e3
    walls, cpus = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        ctl.run(one())
        walls.append((time.perf_counter() - t0) * 1e3)
        cpus.append((time.process_time() - c0) * 1e3)
    return {"warm_check_ms": first, "fanout_ms": float(np.median(walls)), "fanout_ms_range": [min(walls), max(walls)],
            "fanout_client_cpu_ms": float(np.median(cpus))}


def client_waits(sent: dict[str, float], traces: list[Path]) -> np.ndarray:
    arrived = {}
    for trace in traces:
        for line in trace.read_text().splitlines():
            r = json.loads(line)
            arrived.setdefault(r["rid"], r["t"])
    return np.array([arrived[rid] - t for rid, t in sent.items() if rid in arrived])


def weight_update(ctl, client, model_dir: Path, args, work: Path) -> dict:
    """Publishes through the real publisher (disk transfer), servers generating meanwhile: one
    warm-up, then ``--update-rounds`` rounds of one publish in each pause mode (interleaved).
    Per mode, medians and spread (min-max) of: the pause -> resume wall time less the simulated
    transfer (``update_overhead_ms``), each phase, the client's CPU on the update's critical path
    (the publisher's ``held_client_cpu_s``, pause to continue: its thread plus the admin calls' own
    thread and the rollout loop's share in sending them; ``publish_client_cpu_ms`` the whole publish) and this whole process's CPU meanwhile; the simulated servers' CPU of the last round."""
    import torch
    from transformers import AutoModelForCausalLM

    from arealite.config.schema import WeightSyncConfig
    from arealite.sim.cost_model import SimSpec
    from arealite.weight_sync import DiskTransfer, WeightPublisher
    from arealite.weight_sync.base import StateDictSource

    state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    transfer = DiskTransfer(WeightSyncConfig(method="disk", timeout_s=300), client.admin, ctl.run,
                            work / "weights", str(model_dir))
    pub = WeightPublisher(transfer, StateDictSource(state), client.admin, ctl.run, parties=[client], controller=ctl)
    pub.init()
    heads = client.servers[:max(1, min(args.sim_procs, len(client.servers)))]  # one server per process
    sim_s = SimSpec().transfer_s() * args.time_scale
    modes = args.pause_modes.split(",")
    client.admin.pause_mode = modes[0]
    first = pub.publish(1)  # generation settles back after it; the rounds are measured
    version, rows = 1, {m: [] for m in modes}
    for _ in range(args.update_rounds):
        for mode in modes:
            client.admin.pause_mode = mode
            time.sleep(args.resume_s)  # generation back under way, requests in flight again
            version += 1
            sim_cpu0, cpu0 = sim_cpu_s(heads), time.process_time()
            profiler = start_profile(args.profile_update)
            out = pub.publish(version)
            stop_profile(profiler, args.profile_update)
            out["process_cpu_s"] = time.process_time() - cpu0
            out["sim_cpu_s"] = sim_cpu_s(heads) - sim_cpu0
            rows[mode].append(out)
    pub.close()
    result = {"update1_overhead_ms": (paused_s(first) - sim_s) * 1e3, "sim_transfer_ms": sim_s * 1e3, "by_mode": {}}
    for mode, outs in rows.items():
        figures = {"update_overhead_ms": [(paused_s(o) - sim_s) * 1e3 for o in outs],
                   "pause_ms": [o["pause_s"] * 1e3 for o in outs], "transfer_ms": [o["transfer_s"] * 1e3 for o in outs],
                   "verify_ms": [o.get("verify_s", 0.0) * 1e3 for o in outs],
                   "continue_ms": [o["continue_s"] * 1e3 for o in outs],
                   "update_client_cpu_ms": [o["held_client_cpu_s"] * 1e3 for o in outs],
                   "publish_client_cpu_ms": [o["total_client_cpu_s"] * 1e3 for o in outs],
                   "pause_client_cpu_ms": [o["pause_client_cpu_s"] * 1e3 for o in outs],
                   "update_process_cpu_ms": [o["process_cpu_s"] * 1e3 for o in outs],
                   "update_sim_cpu_ms": [o["sim_cpu_s"] * 1e3 for o in outs]}
        result["by_mode"][mode] = {k: median_spread(v) for k, v in figures.items()}
    return result


def median_spread(xs: list[float]) -> dict:
    return {"median": round(float(np.median(xs)), 1), "min": round(min(xs), 1), "max": round(max(xs), 1)}


def paused_s(out: dict) -> float:
    """A publish's pause -> resume wall time."""
    return out["pause_s"] + out["transfer_s"] + out.get("verify_s", 0.0) + out["continue_s"]


def start_profile(path: str | None):
    """yappi over every thread of this process (the controller's loop included), when asked."""
    if not path:
        return None
    import yappi

    yappi.set_clock_type("cpu")
    yappi.start()
    return yappi


def stop_profile(yappi, path: str | None) -> None:
    if yappi is None:
        return
    yappi.stop()
    stats = yappi.get_func_stats()
    stats.sort("tsub")
    with open(path, "w") as f:
        stats.print_all(out=f, columns={0: ("name", 80), 1: ("ncall", 10), 2: ("tsub", 8), 3: ("ttot", 8)})
    yappi.clear_stats()


def sim_cpu_s(heads: list[str]) -> float:
    """CPU seconds of the simulated servers' processes (``heads``: one server of each; the
    servers of a process share its CPU time)."""
    total = 0.0
    for addr in heads:
        with urllib.request.urlopen(f"http://{addr}/server_info", timeout=30) as r:
            total += json.loads(r.read())["internal_states"][0]["cpu_time_s"]
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="8 and 32 servers, less work")
    p.add_argument("--servers", default="8,32,128,256")
    p.add_argument("--per-server", type=int, default=4, help="requests in flight per server")
    p.add_argument("--items", type=int, default=8, help="prompts per server")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--length-median", type=float, default=512)
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="real seconds per simulated second (below ~1, 256 servers saturate two cores)")
    p.add_argument("--admin-rounds", type=int, default=5,
                   help="pause+continue rounds to every idle server, timed (the admin fan-out alone)")
    p.add_argument("--resume-s", type=float, default=3.0,
                   help="seconds of generation between the first (warm-up) update and the measured one")
    p.add_argument("--update-rounds", type=int, default=3,
                   help="measured weight updates per pause mode (--pause-modes), interleaved")
    p.add_argument("--sim-procs", type=int, default=2,
                   help="spread the simulated servers over this many processes (round-robin by port; "
                        "2 on a 2-core machine, so that the client's share of an update can be told apart)")
    p.add_argument("--profile-update", default=None, metavar="FILE",
                   help="profile this process's CPU during each weight update (yappi), functions by own time")
    p.add_argument("--part", choices=["a", "b", "all"], default="all",
                   help="a: AReaL's setup, sync against async (scale_overlap.py); b: scaling")
    add_overlap_arguments(p)
    args = p.parse_args()
    if args.quick:
        args.servers, args.items = "8,32", 4
        args.etas, args.steps, args.skip, args.repeats, args.update_rounds = "0,4", 6, 2, 1, 1
    part_a = run_part_a(args) if args.part in ("a", "all") else {}
    if args.part == "a":
        print(json.dumps(part_a))
        return
    from arealite.models.tiny import build_tiny_model
    from transformers import AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="bench_scale_"))
    model_dir = build_tiny_model(work / "model", size="micro", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    try:
        rows = [run_one(int(n), model_dir, tokenizer, args, work) for n in args.servers.split(",")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = rows[0]
    print(f"{'servers':>7} {'done':>6} {'req/s/server':>12} {'rel':>5} {'CPU us/req':>10} {'growth':>6} "
          f"{'p99 wait ms':>11} {'RSS MB':>7} {'RSS +MB':>7} {'fan-out ms':>10} {'its CPU':>7} {'1st upd.':>8}")
    for r in rows:
        r["rel"] = r["per_server_rps"] / base["per_server_rps"]
        r["cpu_growth"] = r["cpu_us_per_req"] / base["cpu_us_per_req"]
        r["rss_growth_mb"] = r["rss_mb"] - r["rss_quarter_mb"]
        print(f"{r['n']:>7} {r['done']:>6} {r['per_server_rps']:>12.2f} {r['rel']:>5.2f} {r['cpu_us_per_req']:>10.0f} "
              f"{r['cpu_growth']:>6.2f} {r['p99_wait_ms']:>11.1f} {r['rss_mb']:>7.0f} {r['rss_growth_mb']:>7.1f} "
              f"{r['fanout_ms']:>10.1f} {r['fanout_client_cpu_ms']:>7.1f} {r['update1_overhead_ms']:>8.0f}")
    print(f"weight updates, {args.update_rounds} round(s) per mode, interleaved: median [min-max] ms "
          "(overhead = pause -> resume less the simulated transfer; client CPU = the update's critical path)")
    cols = ["update_overhead_ms", "pause_ms", "transfer_ms", "verify_ms", "continue_ms", "update_client_cpu_ms",
            "pause_client_cpu_ms", "publish_client_cpu_ms", "update_process_cpu_ms", "update_sim_cpu_ms"]
    print(f"{'servers':>7} {'mode':>8} " + " ".join(f"{c.removesuffix('_ms'):>22}" for c in cols))
    for r in rows:
        for mode, fig in r["by_mode"].items():
            print(f"{r['n']:>7} {mode:>8} " + " ".join(
                f"{fig[c]['median']:>8.1f} [{fig[c]['min']:.0f}-{fig[c]['max']:.0f}]".rjust(22) for c in cols))
    print("RSS after each batch (MB), largest run: " + ", ".join(f"{x:.0f}" for x in rows[-1]["rss_steps_mb"]))
    last = rows[-1]
    tag = last["n"]
    default = "in_place" if "in_place" in last["by_mode"] else next(iter(last["by_mode"]))
    by_mode = last["by_mode"]
    print(json.dumps({f"scaling_efficiency_{tag}": round(last["rel"], 3),
                      f"cpu_per_request_growth_{tag}": round(last["cpu_growth"], 3),
                      f"update_client_cpu_ms_{tag}": by_mode[default]["update_client_cpu_ms"]["median"],
                      f"update_overhead_ms_{tag}": by_mode[default]["update_overhead_ms"]["median"],
                      **{f"update_overhead_ms_{tag}_{m}": f["update_overhead_ms"] for m, f in by_mode.items()},
                      **{f"update_client_cpu_ms_{tag}_{m}": f["update_client_cpu_ms"] for m, f in by_mode.items()},
                      **{f"update_process_cpu_ms_{tag}_{m}": f["update_process_cpu_ms"] for m, f in by_mode.items()},
                      **{f"update_sim_process_cpu_ms_{tag}_{m}": f["update_sim_cpu_ms"] for m, f in by_mode.items()},
                      "default_pause_mode": default,
                      f"update1_overhead_ms_{tag}": round(last["update1_overhead_ms"], 1),
                      f"warm_check_ms_{tag}": round(last["warm_check_ms"], 1),
                      f"admin_fanout_ms_{tag}": round(last["fanout_ms"], 1),
                      f"admin_fanout_client_cpu_ms_{tag}": round(last["fanout_client_cpu_ms"], 1),
                      f"p99_client_wait_ms_{tag}": round(last["p99_wait_ms"], 1),
                      f"controller_rss_mb_{tag}": round(last["rss_mb"], 1),
                      f"rss_growth_mb_{tag}": round(last["rss_growth_mb"], 1),
                      "time_scale": args.time_scale, "sim_procs": args.sim_procs, "update_rounds": args.update_rounds,
                      "servers": [r["n"] for r in rows], **part_a}))

if __name__ == "__main__":
    main()
