"""One benchmark figure on two checkouts of arealite, runs interleaved: is a change neutral?

A refactor promises "no slower than before". Timing the two trees one after the other on a
shared machine mixes the change with the machine's mood; this runs each benchmark on the
baseline tree and on this one alternately (base, new, base, new, ...), reads the JSON object
each benchmark prints as its last line, and reports the median and spread of the chosen
figures on each side and their ratio (new / base).

    git worktree add /tmp/base <revision>
    python benchmarks/compare_revisions.py --base /tmp/base --rounds 5 \\
        workflow_cpu client train

Each name is a preset (`PRESETS`: the benchmark's quick mode and the figures to compare, with
which way is better). Figures whose median ratio is worse than ``--tolerance`` (default 3%)
are flagged.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

#: name -> (benchmark arguments, {figure: +1 if higher is better, -1 if lower is better}).
#: Each benchmark's own in-run ratio against its baseline arm is listed too: the machine's mood
#: moves both arms of one run alike, so that ratio is the steadier figure on a shared machine.
PRESETS: dict[str, tuple[list[str], dict[str, int]]] = {
    "workflow_cpu": (["bench_workflow_cpu.py", "--quick"],
                     {"rlvr_loop_cpu_us_per_traj": -1, "rlvr_process_cpu_us_per_traj": -1,
                      "rlvr_over_bare_loop_us": -1}),
    "client": (["bench_client.py", "--quick"], {"client_rps": +1, "client_cpu_us_per_req": -1, "ratio": +1}),
    "train": (["bench_train.py", "--quick"],
              {"uniform_engine_tokens_per_s": +1, "varying_engine_tokens_per_s": +1,
               "uniform_speedup": +1, "varying_speedup": +1}),
}


def run_once(tree: Path, args: list[str], timeout: float) -> dict:
    """The last-line JSON object of ``benchmarks/<args>`` run in ``tree`` (its package first on the path)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(tree / "benchmarks" / args[0]), *args[1:]], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{args[0]} in {tree} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def spread(values: list[float]) -> str:
    return f"{min(values):.4g}-{max(values):.4g}"


def compare(base: Path, names: list[str], rounds: int, timeout: float) -> dict:
    """Run each preset ``rounds`` times on each tree, alternating; the figures per tree."""
    got: dict[str, dict[str, dict[str, list[float]]]] = {}
    for r in range(rounds):
        for name in names:
            args, figures = PRESETS[name]
            order = [("base", base), ("new", REPO)] if r % 2 == 0 else [("new", REPO), ("base", base)]
            for side, tree in order:
                out = run_once(tree, args, timeout)
                for fig in figures:
                    got.setdefault(f"{name}.{fig}", {}).setdefault(side, []).append(float(out[fig]))
            print(f"[compare] round {r + 1}/{rounds} {name} done", file=sys.stderr, flush=True)
    return got


def report(got: dict, tolerance: float) -> dict:
    """Print the table; return the summary (median ratio new/base per figure, flagged ones)."""
    summary: dict[str, dict] = {}
    print(f"{'figure':<52}{'base median':>14}{'new median':>14}{'new/base':>10}  spread base | new")
    for key, sides in got.items():
        name, fig = key.split(".", 1)
        sign = PRESETS[name][1][fig]
        b, n = statistics.median(sides["base"]), statistics.median(sides["new"])
        ratio = n / b if b else float("nan")
        worse = (ratio < 1 - tolerance) if sign > 0 else (ratio > 1 + tolerance)
        summary[key] = {"base_median": b, "new_median": n, "ratio": round(ratio, 4),
                        "higher_is_better": sign > 0, "worse_than_tolerance": worse,
                        "base": sides["base"], "new": sides["new"]}
        flag = "  WORSE" if worse else ""
        print(f"{key:<52}{b:>14.4g}{n:>14.4g}{ratio:>10.3f}  {spread(sides['base'])} | {spread(sides['new'])}{flag}")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="+", choices=sorted(PRESETS))
    ap.add_argument("--base", type=Path, required=True, help="the baseline checkout (e.g. a git worktree)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tolerance", type=float, default=0.03)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one benchmark run may take")
    a = ap.parse_args()
    if not (a.base / "benchmarks").is_dir():
        ap.error(f"--base {a.base}: not an arealite checkout (no benchmarks/ folder)")
    summary = report(compare(a.base.resolve(), a.names, a.rounds, a.timeout), a.tolerance)
    print(json.dumps({"benchmark": "compare_revisions", "base": str(a.base), "rounds": a.rounds,
                      "tolerance": a.tolerance, "figures": summary}))


if __name__ == "__main__":
    main()
