"""Asynchronous GRPO with verifiable rewards, through the library trainer.

    python -m arealite.launcher.local examples/rlvr/train.py \
        --config examples/reverse_digits/config.yaml [key=value ...]

The same run needs no script at all: ``python -m arealite.train --config X.yaml``. This
file shows the one call a script makes, for users who build their workflow in Python
(``RLTrainer(cfg, workflow=MyWorkflow(...))``) or add hooks (``hooks=[MyHook()]``).
Every trainer rank (torchrun) runs it; the task is a dataset plus ``data.reward_fn``,
the workflow ``rollout.workflow`` (``rlvr`` by default).
"""

import logging
import sys

from arealite.config.loader import parse_args
from arealite.trainer import RLTrainer


def main(argv: list[str]) -> None:
    cfg = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    RLTrainer(cfg).train()


if __name__ == "__main__":
    main(sys.argv[1:])
