"""The generic entry point: a whole RL run from a YAML file, no training script.

    python -m arealite.train --config X.yaml [key=value ...]

Started by hand, it hands itself to the local launcher (servers first, then itself under
torchrun). Under torchrun, or with server addresses given (``AREALITE_SERVER_ADDRS``), it
is one trainer rank and runs `RLTrainer` with the workflow named in ``rollout.workflow``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from arealite.config.run import ENV_SERVER_ADDRS


def main(argv: Sequence[str] | None = None) -> int:
    """Run the trainer (a rank under torchrun) or launch the whole run; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "RANK" not in os.environ and ENV_SERVER_ADDRS not in os.environ:
        from arealite.launcher.local import main as launch

        return launch(["arealite.train", *argv])
    from arealite.check import parse_run_args
    from arealite.trainer import RLTrainer

    cfg = parse_run_args(argv, prog="python -m arealite.train")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    RLTrainer(cfg).train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
