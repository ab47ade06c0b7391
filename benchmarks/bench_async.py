"""Asynchronous vs synchronous RL: the CPU demo for the same number of steps with
``rollout.max_head_offpolicyness`` (eta) 0 (synchronous), 1, 2 and 4.

    python benchmarks/bench_async.py [--steps N] [--etas 0,1,2,4] [--repeats R] [--quick]

The number of steps defaults to the demo's own (``data.max_train_steps`` of
examples/reverse_digits/config.yaml), so accuracy is compared where the demo ends.

Each run is the full stack (launcher, embedded server, torchrun trainer, distributed
weight sync) from the same warmed-up model. Reported per eta: wall-clock seconds of the
RL steps (from the first step's start to the last step's end, taken from stats.jsonl),
the speed-up over eta = 0, and held-out greedy accuracy before and after RL. Also the
ceiling that overlap allows, from eta = 0's phases: eta 0's wall time
divided by that time less the shorter of its generation and training phases (what full
overlap would hide), and how much of that each eta reaches.
Goal: >= 1.7x for eta = 4 with accuracy within 5 points of eta = 0. Overlap can give
1.7x only when the shorter phase is at least 1 - 1/1.7 (41%) of the synchronous step;
the table says what share it is on the machine at hand.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def run_one(demo: Path, runs: Path, eta: int, steps: int, trainers: int, extra: list[str]) -> dict:
    trial = f"eta{eta}"
    cmd = [
        sys.executable, "-m", "arealite.launcher.local", "examples/rlvr/train.py",
        "--config", "examples/reverse_digits/config.yaml",
        f"experiment.output_root={runs}", f"experiment.trial={trial}",
        f"actor.model_path={demo / 'model'}", f"data.train_path={demo / 'train.jsonl'}",
        f"data.eval_path={demo / 'eval.jsonl'}", f"data.max_train_steps={steps}",
        f"rollout.max_head_offpolicyness={eta}", f"launch.n_trainer_procs={trainers}",
        "evaluation.freq_steps=null", "saver.freq_steps=null", "saver.export_hf_at_end=false",
        "stats.progress_bar=false", "stats.plot=false", *extra,
    ]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True)
    wall_total = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"eta={eta} run failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    records = [json.loads(x) for x in (runs / "reverse_digits" / trial / "stats.jsonl").read_text().splitlines()]
    train = [r for r in records if "time/step_s" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    # Wall time of the RL steps: end of the last step minus start of the first.
    rl_wall = train[-1]["time"] - (train[0]["time"] - train[0]["time/step_s"])
    return {
        "eta": eta, "rl_wall_s": rl_wall, "total_wall_s": wall_total,
        "acc_before": evals[0]["eval/accuracy"], "acc_after": evals[-1]["eval/accuracy"],
        "rollout_wait_s": sum(r["time/rollout_wait_s"] for r in train),
        "train_s": sum(r["time/train_s"] for r in train),
        "weight_sync_s": sum(r["time/weight_sync_s"] for r in train),
        "staleness_mean": sum(r["rollout/staleness_mean"] for r in train) / len(train),
    }


GOAL_SPEEDUP, GOAL_ACC_POINTS, GOAL_ETA = 1.7, 0.05, 4


def demo_steps() -> int:
    """The demo's number of RL steps, read from its config."""
    import yaml

    cfg = yaml.safe_load((REPO / "examples/reverse_digits/config.yaml").read_text())
    return int(cfg["data"]["max_train_steps"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the demo's own)")
    p.add_argument("--etas", default="0,1,2,4")
    p.add_argument("--trainers", type=int, default=1, help="trainer processes (1 leaves a core to the server)")
    p.add_argument("--quick", action="store_true", help="12 steps, eta 0 and 4")
    p.add_argument("--demo-dir", default=None, help="reuse a prepared demo directory")
    p.add_argument("--repeats", type=int, default=1, help="runs per eta (interleaved); medians and means reported")
    n_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    p.add_argument("--server-cpus", type=int, default=n_cpus // 2 or None,
                   help="launch.server_cpus: cores pinned to the server, the rest to the trainer "
                        "(default: half the cores; 0 = no pinning)")
    p.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = p.parse_args()
    steps, etas = (12, [0, 4]) if args.quick else (args.steps or demo_steps(), [int(x) for x in args.etas.split(",")])
    work = Path(tempfile.mkdtemp(prefix="bench_async_"))
    demo = Path(args.demo_dir) if args.demo_dir else work / "demo"
    subprocess.run([sys.executable, "examples/reverse_digits/prepare.py", "--out", str(demo)],
                   cwd=REPO, env=_env(), check=True, capture_output=True)
    overrides = list(args.overrides)
    if args.server_cpus:
        overrides.append(f"launch.server_cpus={args.server_cpus}")
    runs: dict[int, list[dict]] = {eta: [] for eta in etas}
    for rep in range(args.repeats):
        # Interleaved (and reversed every other round) so that machine noise hits every eta alike.
        for eta in (etas if rep % 2 == 0 else etas[::-1]):
            runs[eta].append(run_one(demo, work / "runs" / f"rep{rep}", eta, steps, args.trainers, overrides))
            r = runs[eta][-1]
            print(f"[bench_async] round {rep + 1}/{args.repeats} eta={eta}: {r['rl_wall_s']:.1f} s, "
                  f"accuracy {r['acc_before']:.1%} -> {r['acc_after']:.1%}", file=sys.stderr, flush=True)
    results = []
    for eta in etas:
        rs = runs[eta]
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "eta"}
        med["acc_after"] = statistics.fmean(r["acc_after"] for r in rs)
        results.append({"eta": eta, **med, "rl_wall_s_runs": [r["rl_wall_s"] for r in rs],
                        "acc_after_runs": [r["acc_after"] for r in rs]})
    base = next(r for r in results if r["eta"] == min(etas))
    # What overlap can win at most: it hides the shorter of generation and training, and
    # nothing else of the synchronous run (weight sync, logging) gets shorter.
    g, t, sync = base["rollout_wait_s"], base["train_s"], base["weight_sync_s"]
    bound = base["rl_wall_s"] / (base["rl_wall_s"] - min(g, t))
    pin = f", server pinned to {args.server_cpus} core(s)" if args.server_cpus else ""
    print(f"\nasync GRPO on the CPU demo: {steps} steps, {args.trainers} trainer process(es), 1 server{pin}, "
          f"{args.repeats} run(s) per eta (median wall, mean accuracy)")
    share = min(g, t) / base["rl_wall_s"]
    print(f"eta 0 phases: generation wait {g:.1f} s, training {t:.1f} s, weight sync {sync:.1f} s -> "
          f"overlap can give at most {bound:.2f}x (the shorter phase is {share:.0%} of the step; "
          f"{GOAL_SPEEDUP}x needs {1 - 1 / GOAL_SPEEDUP:.0%})")
    print(f"{'eta':>4} {'RL wall s':>10} {'speed-up':>9} {'of bound':>9} {'wait s':>8} {'train s':>8} {'stale':>6} "
          f"{'acc before':>11} {'acc after':>10}")
    for r in results:
        r["speedup"] = base["rl_wall_s"] / r["rl_wall_s"]
        r["speedup_of_bound"] = (r["speedup"] - 1) / (bound - 1) if bound > 1 else 0.0
        r["acc_delta_vs_sync"] = r["acc_after"] - base["acc_after"]
        print(f"{r['eta']:>4} {r['rl_wall_s']:>10.1f} {r['speedup']:>8.2f}x {r['speedup_of_bound']:>8.0%} "
              f"{r['rollout_wait_s']:>8.1f} {r['train_s']:>8.1f} {r['staleness_mean']:>6.2f} "
              f"{r['acc_before']:>10.1%} {r['acc_after']:>10.1%}")
    goal = {"eta": GOAL_ETA, "speedup": GOAL_SPEEDUP, "acc_points": GOAL_ACC_POINTS}
    target = next((r for r in results if r["eta"] == GOAL_ETA), None)
    if target is not None:
        goal["speedup_met"] = target["speedup"] >= GOAL_SPEEDUP
        goal["accuracy_met"] = target["acc_delta_vs_sync"] >= -GOAL_ACC_POINTS
        print(f"goal at eta {GOAL_ETA}: speed-up {target['speedup']:.2f}x (goal {GOAL_SPEEDUP}x: "
              f"{'met' if goal['speedup_met'] else 'not met'}), accuracy {target['acc_delta_vs_sync'] * 100:+.1f} "
              f"points vs eta 0 (goal within {GOAL_ACC_POINTS * 100:.0f}: "
              f"{'met' if goal['accuracy_met'] else 'not met'})")
    print(json.dumps({"bench": "async", "steps": steps, "trainers": args.trainers, "repeats": args.repeats,
                      "server_cpus": args.server_cpus, "overlap_bound": bound, "short_phase_share": share,
                      "goal": goal, "results": results}))


if __name__ == "__main__":
    main()
