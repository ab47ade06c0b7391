"""Asynchronous vs synchronous RL: the CPU demo through the library trainer
(``python -m arealite.train``) for the same number of steps with
``rollout.max_head_offpolicyness`` (eta) 0 (synchronous), 1, 2 and 4.

    python benchmarks/bench_async.py [--steps N] [--etas 0,1,2,4] [--repeats R]
                                     [--variants demo,gen-heavy] [--quick]

Two variants, each its own table:

- ``demo``: the demo exactly as configured (examples/reverse_digits/config.yaml).
- ``gen-heavy``: generation about half of the synchronous step: 16 samples per prompt and a
  server that batches at most ``--gen-heavy-batch`` (13) sequences at once (a server with
  room for fewer concurrent sequences, as a memory-bound GPU server is), so a step's 256
  samples decode in waves and a group joins the batch over several admissions.

Each run is the full stack (launcher, embedded server, torchrun trainer, distributed
weight sync) from the same warmed-up model. Reported per eta: wall-clock seconds of the RL
steps (first step's start to last step's end, from stats.jsonl), the speed-up over eta = 0,
held-out greedy accuracy after RL, and the share of the overlap bound's gain it reaches,
``(speed-up - 1) / (bound - 1)``. The bound is eta 0's wall time divided by that time less
the shorter of its generation and training phases (what perfect overlap would hide; weight
sync and logging do not overlap).
Goals (issue 13): every eta >= 0.95 of the overlap bound on the demo; on gen-heavy
(bound >= 1.9x) eta = 4 >= 1.8x with accuracy within 5 points of eta = 0.
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

from demo_env import child_env  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

REPO = Path(__file__).resolve().parents[1]
GOAL_OF_BOUND, GOAL_HEAVY_SPEEDUP, GOAL_ACC_POINTS, GOAL_ETA = 0.95, 1.8, 0.05, 4


def _env() -> dict[str, str]:
    return child_env()


def run_one(demo: Path, runs: Path, eta: int, steps: int, trainers: int, extra: list[str]) -> dict:
    """One full run at staleness bound `eta`; its phase times and accuracies."""
    trial = f"eta{eta}"
    cmd = [
        sys.executable, "-m", "arealite.train", "--config", "examples/reverse_digits/config.yaml",
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
    rl_wall = train[-1]["time"] - (train[0]["time"] - train[0]["time/step_s"])
    return {
        "eta": eta, "rl_wall_s": rl_wall, "total_wall_s": wall_total,
        "acc_before": evals[0]["eval/accuracy"], "acc_after": evals[-1]["eval/accuracy"],
        "rollout_wait_s": sum(r["time/rollout_wait_s"] for r in train),
        "train_s": sum(r["time/train_s"] for r in train),
        "weight_sync_s": sum(r["time/weight_sync_s"] for r in train),
        "staleness_mean": sum(r["rollout/staleness_mean"] for r in train) / len(train),
        "interrupted": sum(r.get("client/interrupted_requests", 0.0) for r in train[-1:]),
    }


def summarize(runs: dict[int, list[dict]]) -> tuple[list[dict], dict]:
    """Median phases per eta (mean accuracy), speed-ups, share of the overlap bound."""
    results = []
    for eta, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "eta"}
        med["acc_after"] = statistics.fmean(r["acc_after"] for r in rs)
        results.append({"eta": eta, **med, "rl_wall_s_runs": [r["rl_wall_s"] for r in rs],
                        "acc_after_runs": [r["acc_after"] for r in rs]})
    base = min(results, key=lambda r: r["eta"])
    # Overlap hides the shorter of generation and training, and nothing else.
    g, t = base["rollout_wait_s"], base["train_s"]
    bound = base["rl_wall_s"] / (base["rl_wall_s"] - min(g, t))
    for r in results:
        r["speedup"] = base["rl_wall_s"] / r["rl_wall_s"]
        r["speedup_runs"] = [base["rl_wall_s"] / w for w in r["rl_wall_s_runs"]]
        # The share of what overlap can win that this eta wins: (speed-up - 1) / (bound - 1).
        r["of_bound"] = (r["speedup"] - 1) / (bound - 1) if bound > 1 else 0.0
        r["acc_delta_vs_sync"] = r["acc_after"] - base["acc_after"]
    phases = {"generation_wait_s": g, "train_s": t, "weight_sync_s": base["weight_sync_s"],
              "overlap_bound": bound, "short_phase_share": min(g, t) / base["rl_wall_s"]}
    return results, phases


def print_table(name: str, results: list[dict], phases: dict, header: str) -> dict:
    """The table of one variant; returns its goal verdicts."""
    print(f"\n[{name}] {header}")
    print(f"eta 0 phases: generation wait {phases['generation_wait_s']:.1f} s, training {phases['train_s']:.1f} s, "
          f"weight sync {phases['weight_sync_s']:.1f} s -> overlap bound {phases['overlap_bound']:.2f}x "
          f"(the shorter phase is {phases['short_phase_share']:.0%} of the step)")
    print(f"{'eta':>4} {'RL wall s':>10} {'speed-up':>9} {'runs':>14} {'of bound':>9} {'wait s':>7} {'train s':>8} "
          f"{'sync s':>7} {'stale':>6} {'acc after':>10}")
    for r in results:
        runs = "/".join(f"{x:.2f}" for x in r["speedup_runs"])
        print(f"{r['eta']:>4} {r['rl_wall_s']:>10.1f} {r['speedup']:>8.2f}x {runs:>14} {r['of_bound']:>8.0%} "
              f"{r['rollout_wait_s']:>7.1f} {r['train_s']:>8.1f} {r['weight_sync_s']:>7.1f} "
              f"{r['staleness_mean']:>6.2f} {r['acc_after']:>10.1%}")
    goals: dict = {}
    async_rows = [r for r in results if r["eta"] > 0]
    goals["min_of_bound"] = min((r["of_bound"] for r in async_rows), default=None)
    target = next((r for r in results if r["eta"] == GOAL_ETA), None)
    if target is not None:
        goals["eta4_speedup"] = target["speedup"]
        goals["eta4_acc_delta"] = target["acc_delta_vs_sync"]
    return goals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the demo's own)")
    p.add_argument("--etas", default="0,1,2,4")
    p.add_argument("--variants", default="demo,gen-heavy")
    p.add_argument("--gen-heavy-batch", type=int, default=13, help="server.max_batch_size of gen-heavy")
    p.add_argument("--gen-heavy-samples", type=int, default=16, help="generation.n_samples of gen-heavy")
    p.add_argument("--trainers", type=int, default=1, help="trainer processes (1 leaves a core to the server)")
    p.add_argument("--quick", action="store_true", help="12 steps, eta 0 and 4")
    p.add_argument("--demo-dir", default=None, help="reuse a prepared demo directory")
    p.add_argument("--repeats", type=int, default=2, help="runs per eta (interleaved); medians reported")
    n_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    p.add_argument("--server-cpus", type=int, default=n_cpus // 2 or None,
                   help="launch.server_cpus: cores pinned to the server, the rest to the trainer "
                        "(default: half the cores; 0 = no pinning)")
    p.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = p.parse_args()
    steps = 12 if args.quick else (args.steps or demo_steps())
    etas = [0, 4] if args.quick else [int(x) for x in args.etas.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench_async_"))
    demo = Path(args.demo_dir) if args.demo_dir else work / "demo"
    subprocess.run([sys.executable, "examples/reverse_digits/prepare.py", "--out", str(demo)],
                   cwd=REPO, env=_env(), check=True, capture_output=True)
    common = list(args.overrides) + ([f"launch.server_cpus={args.server_cpus}"] if args.server_cpus else [])
    variants = {"demo": [], "gen-heavy": [f"server.max_batch_size={args.gen_heavy_batch}", f"generation.n_samples={args.gen_heavy_samples}"]}
    out = {"bench": "async", "steps": steps, "trainers": args.trainers, "repeats": args.repeats,
           "server_cpus": args.server_cpus, "variants": {}}
    for name in args.variants.split(","):
        runs: dict[int, list[dict]] = {eta: [] for eta in etas}
        for rep in range(args.repeats):
            # Interleaved, reversed every other round, so that machine noise hits every eta alike.
            for eta in (etas if rep % 2 == 0 else etas[::-1]):
                r = run_one(demo, work / name / f"rep{rep}", eta, steps, args.trainers, common + variants[name])
                runs[eta].append(r)
                print(f"[bench_async] {name} round {rep + 1}/{args.repeats} eta={eta}: {r['rl_wall_s']:.1f} s, "
                      f"accuracy {r['acc_before']:.1%} -> {r['acc_after']:.1%}", file=sys.stderr, flush=True)
        results, phases = summarize(runs)
        header = (f"{steps} steps, {args.trainers} trainer process(es), 1 server"
                  f"{f', pinned to {args.server_cpus} core(s)' if args.server_cpus else ''}; "
                  f"{args.repeats} run(s) per eta (median wall, mean accuracy)")
        goals = print_table(name, results, phases, header)
        out["variants"][name] = {"phases": phases, "goals": goals, "results": results,
                                 "overrides": variants[name]}
    print(json.dumps(out))


def demo_steps() -> int:
    """The demo's number of RL steps, read from its config."""
    import yaml

    cfg = yaml.safe_load((REPO / "examples/reverse_digits/config.yaml").read_text())
    return int(cfg["data"]["max_train_steps"])


if __name__ == "__main__":
    main()
