"""The CPU demo through the local launcher and through the Ray launcher, side by side.

Same config, same machine: the Ray run joins a one-node Ray cluster this script starts
(2 CPUs, servers and trainer ranks at half a CPU each in Ray's books) and places the same
processes through placement groups. Per launcher (median of ``--repeats`` runs, with
the spread):

- time to first step: command start -> the first training step's stats record;
- demo wall clock: command start -> exit.

The figure of merit is Ray / local on the demo's wall clock (goal <= 1.2x).

    python benchmarks/bench_launch.py [--repeats 2] [--steps 20] [--demo-dir DIR]

The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from demo_env import child_env  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

REPO = Path(__file__).resolve().parents[1]
GOAL_RATIO = 1.2


def run_once(launcher: str, demo: Path, runs: Path, trial: str, steps: int, env: dict[str, str]) -> dict:
    """One demo run; returns its time to the first step and its wall clock."""
    module = "arealite.train" if launcher == "local" else "arealite.launcher.ray"
    cmd = [sys.executable, "-m", module, "--config", "examples/reverse_digits/config.yaml",
           f"experiment.output_root={runs}", f"experiment.trial={trial}",
           f"actor.model_path={demo / 'model'}", f"data.train_path={demo / 'train.jsonl'}",
           f"data.eval_path={demo / 'eval.jsonl'}", f"data.max_train_steps={steps}",
           "evaluation.freq_steps=null", "saver.freq_steps=null", "saver.export_hf_at_end=false",
           "recover.mode=disabled", "stats.progress_bar=false", "stats.plot=false",
           "launch.ray.server_cpus=0.5", "launch.ray.trainer_cpus=0.5"]
    t0 = time.time()
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    if res.returncode != 0:
        raise RuntimeError(f"{launcher} run failed ({res.returncode}):\n{res.stderr[-3000:]}")
    stats = runs / "reverse_digits" / trial / "stats.jsonl"
    records = [json.loads(x) for x in stats.read_text().splitlines() if x.strip()]
    first = min(r["time"] for r in records if r.get("step", 0) >= 1 and "time/step_s" in r)
    return {"first_step_s": first - t0, "wall_s": wall}


def start_cluster():
    from ray.cluster_utils import Cluster

    return Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "include_dashboard": False, "object_store_memory": 80 * 2**20})


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--demo-dir", default=None, help="reuse a prepared demo directory")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_launch_"))
    demo = Path(args.demo_dir) if args.demo_dir else work / "demo"
    env = child_env()
    if not args.demo_dir:
        subprocess.run([sys.executable, "examples/reverse_digits/prepare.py", "--out", str(demo)],
                       cwd=REPO, env=env, check=True, capture_output=True)
    cluster = start_cluster()
    ray_env = dict(env, RAY_ADDRESS=cluster.address)
    runs: dict[str, list[dict]] = {"local": [], "ray": []}
    try:
        for i in range(args.repeats):  # interleaved, so that a busy moment hits both
            for launcher in ("local", "ray"):
                r = run_once(launcher, demo, work / "runs", f"{launcher}{i}", args.steps,
                             ray_env if launcher == "ray" else env)
                runs[launcher].append(r)
                print(f"[bench_launch] {launcher} run {i}: first step after {r['first_step_s']:.1f}s, "
                      f"{r['wall_s']:.1f}s in all", file=sys.stderr, flush=True)
    finally:
        cluster.shutdown()
    figs = {k: {m: summary([r[m] for r in v]) for m in ("first_step_s", "wall_s")} for k, v in runs.items()}
    ratio = figs["ray"]["wall_s"]["median"] / figs["local"]["wall_s"]["median"]
    print(f"\nthe CPU demo, {args.steps} steps, median of {args.repeats} (min-max)")
    print(f"{'launcher':<10}{'first step (s)':>22}{'wall clock (s)':>22}")
    for k, f in figs.items():
        a, b = f["first_step_s"], f["wall_s"]
        print(f"{k:<10}{a['median']:>9.1f} ({a['min']:.1f}-{a['max']:.1f}){'':>3}"
              f"{b['median']:>9.1f} ({b['min']:.1f}-{b['max']:.1f})")
    print(f"Ray / local on the demo's wall clock: {ratio:.2f}x (goal <= {GOAL_RATIO}x)")
    print(json.dumps({"bench": "launch", "steps": args.steps, "repeats": args.repeats, **figs,
                      "ray_over_local_wall": round(ratio, 3), "goal_ratio": GOAL_RATIO}))


if __name__ == "__main__":
    main()
