"""Part (a) of bench_scale.py: AReaL's setup simulated, synchronous against asynchronous RL.

Each run is a whole ``python -m arealite.train``: simulated inference servers
(``launch.server_backend: sim``) and the simulated train engine (``actor.backend: sim``),
everything else real (RLTrainer, controller, client, RLVR workflow and its reward, the
staleness bound, the weight publisher). One run per ``max_head_offpolicyness`` eta in
0, 1, 2, 4, 8 with the same seed, prompts and cost model. Throughput is training steps per
second of wall time over the steps after the first ``--skip``; the speed-up is its ratio to
eta = 0.

The bound is what the same cost model allows with perfect overlap: from the eta = 0 run,
a step is generation (the trainer's wait for its batch) plus training and the weight push;
overlapped, it is the longer of the two. ``bound = (gen + train) / max(gen, train)``.

GPU split as AReaL's paper (arXiv 2505.24298): three generation GPUs for one training GPU,
H800s, a 1.5B model; the batch and the answer lengths are scaled down so that the
orchestration fits two CPU cores (docs/scale.md).

    python benchmarks/scale_overlap.py [--quick] [--etas 0,1,2,4,8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PAPER_SPEEDUP = 2.77  # AReaL's abstract: "up to 2.77x" over synchronous systems on the same GPUs


def prepare_demo(work: Path, n_train: int) -> Path:
    out = work / "demo"
    subprocess.run([sys.executable, "examples/reverse_digits/prepare.py", "--out", str(out), "--size", "micro",
                    "--n-train", str(n_train), "--n-eval", "8", "--warmup-steps", "5", "--batch-size", "8"],
                   cwd=REPO, check=True, capture_output=True, timeout=600,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    return out


def run_config(args, demo: Path, runs: Path, eta: int) -> dict:
    return {
        "experiment": {"name": "overlap", "trial": f"eta{eta}", "output_root": str(runs), "seed": 1},
        "launch": {"n_servers": args.gen_gpus, "n_trainer_procs": 1, "server_backend": "sim"},
        "server": {"context_length": 32768, "sim": {"gpu": "h100", "model": args.model, "time_scale": args.a_time_scale,
                           "length_median": args.a_length_median, "length_sigma": 1.0}},
        "rollout": {"consumer_batch_size": args.batch, "max_head_offpolicyness": eta},
        "generation": {"n_samples": args.n_samples, "max_new_tokens": args.a_max_new_tokens},
        "actor": {"model_path": str(demo / "model"), "backend": "sim",
                  "sim": {"gpu": "h800", "model": args.model, "n_gpus": args.train_gpus, "mfu": args.mfu}},
        "data": {"train_path": str(demo / "train.jsonl"), "eval_path": None,
                 "reward_fn": "arealite.reward.reverse_digits:reverse_digits_reward",
                 "max_train_steps": args.steps},
        "evaluation": {"freq_steps": None},
        "saver": {"export_hf_at_end": False, "freq_steps": None},
        "stats": {"progress_bar": False, "plot": False},
        "weight_sync": {"bucket_size_mb": 1, "probe": False},
    }


def one_run(args, demo: Path, work: Path, eta: int) -> dict:
    runs = work / f"runs_eta{eta}"
    cfg_path = work / f"eta{eta}.yaml"
    cfg_path.write_text(yaml.safe_dump(run_config(args, demo, runs, eta)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-m", "arealite.train", "--config", str(cfg_path)], cwd=work, env=env,
                         capture_output=True, text=True, timeout=1800, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"eta={eta}: the run failed\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    recs = [json.loads(x) for x in (runs / "overlap" / f"eta{eta}" / "stats.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "time/step_s" in r and "rollout/prompt_ids" in r]
    kept = steps[args.skip:]
    span = kept[-1]["time"] - steps[args.skip - 1]["time"] if args.skip else kept[-1]["time"] - kept[0]["time"]
    n = len(kept) if args.skip else len(kept) - 1
    med = lambda k: statistics.median(r.get(k, 0.0) for r in kept)
    return {"eta": eta, "steps_per_s": n / span, "step_s": span / n, "gen_s": med("time/rollout_wait_s"),
            "train_s": med("time/train_s") + med("time/weight_sync_s"),
            "staleness_max": max(r["rollout/staleness_max"] for r in kept),
            "answer_len": med("rollout/response_len_mean"),
            "seq_len": med("rollout/n_tokens") / max(1.0, med("rollout/n_trajectories"))}


def busy_generation_s(args, answer_len: float, seq_len: float) -> float:
    """Real seconds the generation servers take for one batch's tokens when never idle: every
    server decoding a full batch (``server.max_batch_size`` = 64 rows), under the servers' own
    cost model (`SimSpec`)."""
    from arealite.server.sim_model import SimSpec

    spec = SimSpec(gpu="h100", model=args.model)
    rows = 64
    kv = rows * (seq_len - answer_len / 2)  # on average half of each answer is in the cache
    tokens_per_s = args.gen_gpus * rows / spec.step_s(rows, int(kv))
    return args.batch * args.n_samples * answer_len / tokens_per_s * args.a_time_scale


def run_part_a(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="scale_overlap_"))
    try:
        demo = prepare_demo(work, n_train=args.batch * (args.steps + 1))
        rows = [one_run(args, demo, work, int(e)) for e in args.etas.split(",")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sync = rows[0]
    gen, train = sync["gen_s"], sync["train_s"]
    overlap = (gen + train) / max(gen, train)  # eta=0's generation, tail included, hidden behind training
    busy = busy_generation_s(args, sync["answer_len"], sync["seq_len"])
    bound = sync["step_s"] / max(busy, train)  # generation never idle and overlapped with training
    print(f"part (a): {args.gen_gpus} generation + {args.train_gpus} training GPUs, {args.model}, batch "
          f"{args.batch}x{args.n_samples}, answers lognormal median {args.a_length_median:.0f} capped "
          f"{args.a_max_new_tokens}, time_scale {args.a_time_scale}")
    print(f"eta=0 step: generation wait {gen:.3f} s + train and push {train:.3f} s (real seconds); "
          f"overlap alone {overlap:.2f}x; busy generation of a batch {busy:.3f} s; "
          f"bound max(busy, train) {bound:.2f}x; paper {PAPER_SPEEDUP}x")
    print(f"{'eta':>4} {'steps/s':>8} {'step s':>7} {'speed-up':>8} {'of bound':>8} {'staleness max':>13}")
    for r in rows:
        r["speedup"] = r["steps_per_s"] / sync["steps_per_s"]
        r["of_bound"] = r["speedup"] / bound
        print(f"{r['eta']:>4} {r['steps_per_s']:>8.3f} {r['step_s']:>7.3f} {r['speedup']:>8.2f} "
              f"{r['of_bound']:>8.2f} {r['staleness_max']:>13}")
    by_eta = {r["eta"]: r for r in rows}
    out = {"bound_speedup": round(bound, 3), "overlap_only_speedup": round(overlap, 3),
           "busy_generation_s": round(busy, 4), "train_push_s": round(train, 4), "paper_speedup": PAPER_SPEEDUP,
           "speedup_by_eta": {str(r["eta"]): round(r["speedup"], 3) for r in rows}}
    if 4 in by_eta:
        out["eta4_of_bound"] = round(by_eta[4]["of_bound"], 3)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("part (a): AReaL's setup simulated (scale_overlap.py)")
    g.add_argument("--etas", default="0,1,2,4,8")
    g.add_argument("--gen-gpus", type=int, default=3, help="simulated generation servers (1 GPU each)")
    g.add_argument("--train-gpus", type=int, default=1)
    g.add_argument("--model", default="1.5b", choices=["1.5b", "7b", "14b", "32b"])
    g.add_argument("--mfu", type=float, default=0.4)
    g.add_argument("--batch", type=int, default=16, help="prompts per step")
    g.add_argument("--n-samples", type=int, default=4, help="answers per prompt")
    g.add_argument("--a-max-new-tokens", dest="a_max_new_tokens", type=int, default=2048)
    g.add_argument("--a-length-median", dest="a_length_median", type=float, default=1024)
    g.add_argument("--steps", type=int, default=10)
    g.add_argument("--skip", type=int, default=2, help="steps left out of the throughput (warm-up)")
    g.add_argument("--a-time-scale", dest="a_time_scale", type=float, default=0.1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(p)
    p.add_argument("--quick", action="store_true", help="eta 0 and 4, 6 steps")
    args = p.parse_args()
    if args.quick:
        args.etas, args.steps = "0,4", 6
    print(json.dumps(run_part_a(args)))


if __name__ == "__main__":
    main()
