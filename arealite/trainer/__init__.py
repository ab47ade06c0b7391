"""The library training loop: ``RLTrainer(config, workflow=None).train()``.

Users write a workflow and a YAML file; this package owns everything else (data,
engines, controller, weight publishing, checkpoints, evaluation, stats, plots,
export, teardown). `TrainerHook` adds behaviour without copying the loop.
"""

from arealite.trainer.hooks import CallbackHook, TrainerHook, TrainerView
from arealite.trainer.rl_trainer import RLTrainer
from arealite.trainer.step_stats import StepStats

__all__ = ["CallbackHook", "RLTrainer", "StepStats", "TrainerHook", "TrainerView"]
