"""A run's config checked in full, before anything starts.

    python -m arealite.check [CFG] [key=value ...] [--no-paths] [--launch]

The config package judges what a config alone can tell (`arealite.config.load_config`).
The names a config gives to pieces of the packages above it are judged by the packages
that resolve them (`NAME_CHECKS`): the advantage estimator and the policy loss
(`arealite.algo`), the reward function (`arealite.reward`), the workflow and its
kwargs (`arealite.workflow.registry`). The train engine judges its parallel layout
(``sp_size``, ``tp_size``) on the trainer's ranks and the model (`RUN_CHECKS`,
`arealite.train_engine.parallel.layout`), and the planner whether every trainer rank and
server fits on the GPUs ``launch.gpus`` names (`arealite.plan.run_plan.fit_problems`). Everything that starts a run loads its config
here, so that every problem is reported in one round, naming the field: the launchers,
`python -m arealite.train`, and `RLTrainer` for a config built in code (`check_names`).

Exit status of the command: 0 when the config is valid, 1 when it is not (problems on
stderr), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from arealite.algo.advantage import estimator_problems
from arealite.algo.loss import policy_loss_problems
from arealite.config.cross_field_checks import config_advice
from arealite.config.launch_checks import check_launch
from arealite.config.loader import ConfigError, load_config, parse_args, split_config_args
from arealite.config.problems import ConfigCheck
from arealite.config.schema import ArealiteConfig
from arealite.plan.run_plan import fit_problems
from arealite.plan.shared_split import shared_split_problems
from arealite.reward import reward_fn_problems
from arealite.train_engine.parallel.layout import run_layout_problems
from arealite.workflow.registry import workflow_problems

__all__ = ["NAME_CHECKS", "RUN_CHECKS", "check_names", "load_run_config", "main", "parse_run_args"]

#: Names of the algorithm's pieces, resolved by `PPOActor`.
_ALGORITHM_CHECKS: tuple[ConfigCheck, ...] = (estimator_problems, policy_loss_problems)
#: Names of the workflow and its reward function, resolved when the workflow is built from config.
_WORKFLOW_CHECKS: tuple[ConfigCheck, ...] = (reward_fn_problems, workflow_problems)
#: The checks of names that only the packages resolving them can judge.
NAME_CHECKS: tuple[ConfigCheck, ...] = _ALGORITHM_CHECKS + _WORKFLOW_CHECKS
#: Every check of a run's config beyond the config package's own: the names, the train
#: engines' parallel layouts on the trainer's ranks (with the models' configs where they exist),
#: and, when ``launch.gpus`` names the cluster's GPUs, whether every process fits in its memory
#: (with ``launch.placement: shared``, trainer and server together on one card).
RUN_CHECKS: tuple[ConfigCheck, ...] = NAME_CHECKS + (run_layout_problems, fit_problems,
                                                   shared_split_problems)


def check_names(cfg: ArealiteConfig, *, workflow_from_config: bool = True) -> ArealiteConfig:
    """Raise `ConfigError` if a name in `cfg` resolves to nothing usable; else return `cfg`.

    Without `workflow_from_config` (a workflow object given in code) the names of the
    workflow and its reward function, which nothing will resolve, are left alone.
    """
    checks = NAME_CHECKS if workflow_from_config else _ALGORITHM_CHECKS
    problems = [p for check in checks for p in check(cfg)]
    if problems:
        raise ConfigError(problems)
    return cfg


def load_run_config(path: str | os.PathLike | None, overrides: Sequence[str] = (), *,
                    check_paths: bool = True) -> ArealiteConfig:
    """`load_config` with `RUN_CHECKS`: raises `ConfigError` listing every problem."""
    return load_config(path, overrides, check_paths=check_paths, extra_checks=RUN_CHECKS)


def parse_run_args(argv: Sequence[str] | None = None, *, check_paths: bool = True, exit_on_error: bool = True,
                   prog: str | None = None) -> ArealiteConfig:
    """`parse_args` (`--config CFG key=value ...`) with `RUN_CHECKS`."""
    return parse_args(argv, check_paths=check_paths, exit_on_error=exit_on_error, prog=prog,
                      extra_checks=RUN_CHECKS)


def main(argv: Sequence[str] | None = None) -> int:
    """Validate a run's config from the command line; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m arealite.check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("args", nargs="*", metavar="CFG | key=value")
    parser.add_argument("--no-paths", action="store_true", help="do not check model/data paths")
    parser.add_argument("--launch", action="store_true", help="also run the local launcher's checks")
    args = parser.parse_intermixed_args(argv)  # options may come among the overrides
    path, overrides = split_config_args(args.args)
    try:
        cfg = load_run_config(path, overrides, check_paths=not args.no_paths)
        if args.launch:
            check_launch(cfg)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 1
    for advice in config_advice(cfg):  # runs, but likely not what is wanted
        print(f"advice: {advice}", file=sys.stderr)
    print(f"OK: {path or 'defaults'}" + (f" with {len(overrides)} override(s)" if overrides else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
