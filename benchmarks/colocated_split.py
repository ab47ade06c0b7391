"""The time-shared placement's step, split: what a colocated run's stats say (`launch.placement:
colocated`, docs/placement.md).

    python benchmarks/colocated_split.py RUN_DIR/stats.jsonl

Prints, per step and as medians (with the spread, min..max) over the steps after the first:
the step time split into generate / release / onload / train / push (of which offload and the
two wakes) and, on a GPU, the card's free memory before and after each release and the trainer's
``torch.cuda.memory_allocated`` before and after each offload. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

#: (column, stats key): the step's phases in the order they run.
PHASES = (
    ("generate", "time/rollout_wait_s"),
    ("release", "colocation/release_s"),
    ("onload", "colocation/onload_s"),
    ("train", "time/train_s"),
    ("push", "time/weight_sync_s"),
    ("offload", "colocation/offload_s"),
    ("wake_w", "colocation/wake_weights_s"),
    ("wake_kv", "colocation/wake_kv_cache_s"),
)
MEMORY = (
    ("free_before_release_gib", "colocation/gpu_free_gib_before_release"),
    ("free_after_release_gib", "colocation/gpu_free_gib_after_release"),
    ("trainer_before_offload_gib", "colocation/trainer_allocated_gib_before_offload"),
    ("trainer_after_offload_gib", "colocation/trainer_allocated_gib_after_offload"),
)


def step_records(path: Path) -> list[dict]:
    """The records of training steps (those with a switch), in order."""
    out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in out if "colocation/onload_s" in r]


def summary(records: list[dict]) -> dict[str, dict[str, float]]:
    """Median, min and max of every column over the steps after the first (warm-up)."""
    body = records[1:] or records
    out = {}
    for name, key in PHASES + MEMORY:
        xs = [float(r[key]) for r in body if key in r]
        if xs:
            out[name] = {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stats", type=Path, help="the run's stats.jsonl")
    args = ap.parse_args(argv)
    records = step_records(args.stats)
    if not records:
        print(f"{args.stats}: no step of a colocated run (no colocation/onload_s)", file=sys.stderr)
        return 1
    cols = [n for n, k in PHASES + MEMORY if any(k in r for r in records)]
    keys = dict(PHASES + MEMORY)
    print("step " + " ".join(f"{c:>12}" for c in cols))
    for r in records:
        print(f"{r['step']:>4} " + " ".join(f"{r.get(keys[c], float('nan')):>12.3f}" for c in cols))
    s = summary(records)
    print("med  " + " ".join(f"{s[c]['median']:>12.3f}" for c in cols))
    print("span " + " ".join(f"{s[c]['max'] - s[c]['min']:>12.3f}" for c in cols))
    print(json.dumps({"steps": len(records), **{f"{c}_median": round(s[c]["median"], 4) for c in cols}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
