"""The algorithms side by side on the CPU demo (reverse digits), through the library trainer
(``python -m arealite.train``): the same seeds, steps and settings for every method, each
changing only what defines it (its documented defaults; none is tuned to win).

    python benchmarks/bench_algorithms.py [--steps N] [--seeds 1,2] [--methods grpo,gspo,...]
                                          [--demo-dir DIR] [--docs] [overrides ...]

Reported per method (mean over seeds): final held-out greedy accuracy, the area under the
held-out accuracy curve (trapezoids over the evaluated steps, divided by the steps: the
mean accuracy along the run), and wall-clock seconds per step. With ``--docs`` the table
and one PNG of the curves go to docs/algorithms.md (between the benchmark markers) and
docs/algorithms_curves.png. The last line printed is the JSON of everything.
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
DOC = REPO / "docs" / "algorithms.md"
PNG = REPO / "docs" / "algorithms_curves.png"
START, END = "<!-- bench_algorithms:start -->", "<!-- bench_algorithms:end -->"

#: Each method: the overrides that define it on top of the demo's config (docs/algorithms.md).
_TIS = ["algorithm.mismatch.mode=tis", "algorithm.mismatch.level=token", "algorithm.mismatch.upper=2.0"]
_GAE = ["algorithm.adv_estimator=gae", "critic.enabled=true", "algorithm.adv_norm=batch"]
METHODS: dict[str, list[str]] = {
    "grpo": ["algorithm.adv_estimator=grpo"],
    "drgrpo": ["algorithm.adv_estimator=drgrpo"],
    "rloo": ["algorithm.adv_estimator=rloo"],
    "reinforce_pp": ["algorithm.adv_estimator=reinforce_pp", "algorithm.adv_norm=batch"],
    "reinforce_pp_baseline": ["algorithm.adv_estimator=reinforce_pp_baseline", "algorithm.adv_norm=batch"],
    "gspo": ["algorithm.policy_loss=gspo", "algorithm.eps_clip=3.0e-4", "algorithm.eps_clip_high=4.0e-4",
             "algorithm.loss_agg_mode=seq-mean-token-mean"],
    "grpo+tis": ["algorithm.adv_estimator=grpo", *_TIS],
    "ppo_gae": _GAE,
    "ppo_gae+tis": [*_GAE, *_TIS],
}
DEFAULT_METHODS = "grpo,drgrpo,rloo,reinforce_pp,gspo,ppo_gae,ppo_gae+tis"


def _env() -> dict[str, str]:
    return child_env()


def run_one(demo: Path, runs: Path, method: str, seed: int, steps: int, extra: list[str]) -> dict:
    """One full run of ``method`` with ``seed``: its held-out accuracy curve and step times."""
    trial = f"{method.replace('+', '_')}_s{seed}"
    cmd = [
        sys.executable, "-m", "arealite.train", "--config", "examples/reverse_digits/config.yaml",
        f"experiment.output_root={runs}", f"experiment.trial={trial}", f"experiment.seed={seed}",
        f"actor.model_path={demo / 'model'}", f"data.train_path={demo / 'train.jsonl'}",
        f"data.eval_path={demo / 'eval.jsonl'}", f"data.max_train_steps={steps}",
        "saver.freq_steps=null", "saver.export_hf_at_end=false", "recover.mode=disabled",
        "stats.progress_bar=false", "stats.plot=false", *METHODS[method], *extra,
    ]
    t0 = time.perf_counter()
    path = runs / "reverse_digits" / trial / "stats.jsonl"
    records = _finished(path, steps)
    if records is None:
        res = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{method} seed {seed} failed ({res.returncode}):\n{res.stdout[-2000:]}\n"
                               f"{res.stderr[-3000:]}")
        records = [json.loads(x) for x in path.read_text().splitlines()]
    curve = sorted({int(r["step"]): r["eval/accuracy"] for r in records if "eval/accuracy" in r}.items())
    train = [r for r in records if "time/step_s" in r]
    return {"method": method, "seed": seed, "curve": curve, "final_acc": curve[-1][1],
            "auc": area_under(curve, steps), "step_s": statistics.fmean(r["time/step_s"] for r in train),
            "wall_s": time.perf_counter() - t0}


def _finished(path: Path, steps: int) -> list[dict] | None:
    """The records of a run that already finished all its steps at `path`, else None."""
    if not path.is_file():
        return None
    records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    done = any(r.get("run/end_step") == steps for r in records)
    return records if done else None


def area_under(curve: list[tuple[int, float]], steps: int) -> float:
    """Trapezoid area under accuracy(step) from the first to the last evaluated step, over the steps."""
    if len(curve) < 2:
        return curve[0][1] if curve else 0.0
    area = sum((s1 - s0) * (a0 + a1) / 2 for (s0, a0), (s1, a1) in zip(curve, curve[1:]))
    return area / max(curve[-1][0] - curve[0][0], 1)


def summarize(results: list[dict]) -> list[dict]:
    """Mean over seeds per method, in the order the methods ran."""
    rows = []
    for method in dict.fromkeys(r["method"] for r in results):
        rs = [r for r in results if r["method"] == method]
        rows.append({"method": method, "seeds": [r["seed"] for r in rs],
                     "acc_before": statistics.fmean(r["curve"][0][1] for r in rs),
                     "final_acc": statistics.fmean(r["final_acc"] for r in rs),
                     "auc": statistics.fmean(r["auc"] for r in rs),
                     "step_s": statistics.fmean(r["step_s"] for r in rs),
                     "overrides": METHODS[method]})
    return rows


def table(rows: list[dict], header: str) -> str:
    lines = [header, "", "| method | held-out acc. before | final held-out acc. | area under acc. curve | s / step |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['acc_before']:.1%} | {r['final_acc']:.1%} | {r['auc']:.1%} | "
                     f"{r['step_s']:.2f} |")
    return "\n".join(lines)


def plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for method in dict.fromkeys(r["method"] for r in results):
        rs = [r for r in results if r["method"] == method]
        steps = [s for s, _ in rs[0]["curve"]]
        acc = [statistics.fmean(dict(r["curve"]).get(s, 0.0) for r in rs) for s in steps]
        ax.plot(steps, acc, marker="o", label=method)
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("reverse-digits demo: algorithms side by side")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def write_docs(markdown: str) -> None:
    """Replace the benchmark section of docs/algorithms.md (between its markers)."""
    text = DOC.read_text()
    if START not in text or END not in text:
        raise RuntimeError(f"{DOC} lacks the markers {START} / {END}")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    DOC.write_text(f"{head}{START}\n{markdown}\n\n![held-out accuracy per method]({PNG.name})\n{END}{tail}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the demo's own)")
    p.add_argument("--seeds", default="1,2", help="experiment.seed values, the same for every method")
    p.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--demo-dir", default=None, help="reuse a prepared demo directory")
    p.add_argument("--runs-dir", default=None,
                   help="keep the runs here; a run that finished there before is read, not repeated "
                        "(resumes a benchmark that was interrupted)")
    p.add_argument("--prepare-args", default="", help="extra arguments of examples/reverse_digits/prepare.py")
    p.add_argument("--docs", action="store_true", help="write the table and PNG into docs/")
    p.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = p.parse_args()
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    steps = args.steps or demo_steps()
    seeds = [int(s) for s in args.seeds.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench_algorithms_"))
    demo = Path(args.demo_dir) if args.demo_dir else work / "demo"
    subprocess.run([sys.executable, "examples/reverse_digits/prepare.py", "--out", str(demo),
                    *args.prepare_args.split()], cwd=REPO, env=_env(), check=True, capture_output=True)
    results = []
    for seed in seeds:
        for method in methods:
            runs = Path(args.runs_dir) if args.runs_dir else work / "runs"
            r = run_one(demo, runs, method, seed, steps, list(args.overrides))
            results.append(r)
            print(f"[bench_algorithms] {method} seed {seed}: accuracy {r['curve'][0][1]:.1%} -> {r['final_acc']:.1%}, "
                  f"{r['step_s']:.2f} s/step", file=sys.stderr, flush=True)
    rows = summarize(results)
    header = (f"{steps} RL steps on the reverse-digits demo (examples/reverse_digits/config.yaml), seeds "
              f"{', '.join(map(str, seeds))} (means over seeds); every method has the demo's settings plus the "
              "overrides that define it.")
    md = table(rows, header)
    print(md)
    if args.docs:
        plot(results, PNG)
        write_docs(md)
    print(json.dumps({"bench": "algorithms", "steps": steps, "seeds": seeds, "rows": rows,
                      "runs": [{k: v for k, v in r.items()} for r in results]}))


def demo_steps() -> int:
    """The demo's number of RL steps, read from its config."""
    import yaml

    cfg = yaml.safe_load((REPO / "examples/reverse_digits/config.yaml").read_text())
    return int(cfg["data"]["max_train_steps"])


if __name__ == "__main__":
    main()
