"""Will it fit, and how fast: a run's plan on a named cluster, before anything starts.

    python -m arealite.plan [CFG] [key=value ...] --gpus 8xH100 [--gpu-memory-gib N] [--mfu X] [--png FILE]
                             [--no-attainable]

Prints every trainer rank's memory (parameters, gradients, optimizer state, FSDP2 buffers,
activations, the head's chunk, ...) and every server's (weights, KV cache, how many answers
of the configured length run at once) against the card, the predicted throughput, the split
of the GPUs that balances generation and training, the asynchronous speed-up bound, and what
the staleness bound lets the run reach at each eta (played in virtual time, a few seconds;
``--no-attainable`` skips it); for a layout that will not fit, the cheapest change that does.
``--gpus`` defaults to ``launch.gpus``.

Exit status: 0 when everything fits, 1 when something does not, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from arealite.config.loader import ConfigError, load_config, split_config_args

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m arealite.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("args", nargs="*", metavar="CFG | key=value")
    parser.add_argument("--gpus", help="the cluster's GPUs: 8xH100, 2x8xH100 (nodes x per node), H200, ...")
    parser.add_argument("--gpu-memory-gib", type=float, help="one GPU's memory, when not the named card's")
    parser.add_argument("--mfu", type=float, help="training MFU to assume (default: the measured one)")
    parser.add_argument("--png", help="draw each process's memory as a stacked bar against the card")
    parser.add_argument("--no-attainable", action="store_true",
                        help="skip the speed-up the staleness bound allows at each eta (a few seconds of simulation)")
    args = parser.parse_intermixed_args(argv)
    path, overrides = split_config_args(args.args)
    from arealite.plan.attainable import plan_attainable
    from arealite.plan.gpus import parse_gpus
    from arealite.plan.run_plan import plan_problems, plan_run

    try:
        cfg = load_config(path, overrides, check_paths=False)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    gpus = args.gpus or cfg.launch.gpus
    if not gpus:
        parser.error("name the cluster's GPUs: --gpus 8xH100 (or launch.gpus in the config)")
    try:
        cluster = parse_gpus(gpus, memory_gib=args.gpu_memory_gib or cfg.launch.gpu_memory_gib)
        plan = plan_run(cfg, cluster, mfu=args.mfu)
        if not args.no_attainable and plan.throughput is not None:
            plan.attainable = plan_attainable(cfg, plan.throughput)
    except ValueError as e:
        print(f"python -m arealite.plan: {e}", file=sys.stderr)
        return 2
    print(plan.table())
    if args.png:
        from arealite.plan.picture import draw_plan

        draw_plan(plan, args.png)
        print(f"\nmemory picture: {args.png}")
    problems = plan_problems(plan)
    for p in problems:
        print(f"\nwill not fit: {p.format()}", file=sys.stderr)
    if not problems:
        print("\nfits: every process is predicted within its card's memory")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
