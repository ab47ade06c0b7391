"""Asynchronous vs synchronous RL: the CPU demo for the same number of steps with
``rollout.max_head_offpolicyness`` (eta) 0 (synchronous), 1, 2 and 4.

    python benchmarks/bench_async.py [--steps 40] [--etas 0,1,2,4] [--quick]

Each run is the full stack (launcher, embedded server, torchrun trainer, distributed
weight sync) from the same warmed-up model. Reported per eta: wall-clock seconds of the
RL steps (from the first step's start to the last step's end, taken from stats.jsonl),
the speed-up over eta = 0, and held-out greedy accuracy before and after RL.
Goal: >= 1.7x for eta = 4 with accuracy within 5 points of eta = 0.
"""

from __future__ import annotations

import argparse
import json
import os
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
        "staleness_mean": sum(r["rollout/staleness_mean"] for r in train) / len(train),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--etas", default="0,1,2,4")
    p.add_argument("--trainers", type=int, default=1, help="trainer processes (1 leaves a core to the server)")
    p.add_argument("--quick", action="store_true", help="12 steps, eta 0 and 4")
    p.add_argument("--demo-dir", default=None, help="reuse a prepared demo directory")
    p.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = p.parse_args()
    steps, etas = (12, [0, 4]) if args.quick else (args.steps, [int(x) for x in args.etas.split(",")])
    work = Path(tempfile.mkdtemp(prefix="bench_async_"))
    demo = Path(args.demo_dir) if args.demo_dir else work / "demo"
    subprocess.run([sys.executable, "examples/reverse_digits/prepare.py", "--out", str(demo)],
                   cwd=REPO, env=_env(), check=True, capture_output=True)
    results = [run_one(demo, work / "runs", eta, steps, args.trainers, args.overrides) for eta in etas]
    base = next(r for r in results if r["eta"] == min(etas))
    print(f"\nasync GRPO on the CPU demo: {steps} steps, {args.trainers} trainer process(es), 1 server")
    print(f"{'eta':>4} {'RL wall s':>10} {'speed-up':>9} {'wait s':>8} {'stale':>6} {'acc before':>11} {'acc after':>10}")
    for r in results:
        r["speedup"] = base["rl_wall_s"] / r["rl_wall_s"]
        r["acc_delta_vs_sync"] = r["acc_after"] - base["acc_after"]
        print(f"{r['eta']:>4} {r['rl_wall_s']:>10.1f} {r['speedup']:>8.2f}x {r['rollout_wait_s']:>8.1f} "
              f"{r['staleness_mean']:>6.2f} {r['acc_before']:>10.1%} {r['acc_after']:>10.1%}")
    print(json.dumps({"bench": "async", "steps": steps, "trainers": args.trainers, "results": results}))


if __name__ == "__main__":
    main()
