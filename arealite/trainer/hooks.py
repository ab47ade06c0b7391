"""Hooks: where a user adds behaviour to the library loop without copying it.

Subclass `TrainerHook`, override the methods you need, and pass instances to
``RLTrainer(config, hooks=[...])``. Every trainer rank calls them; guard with
``trainer.rank == 0`` for work that should happen once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensordict import TensorDictBase

    from arealite.trainer.rl_trainer import RLTrainer


class TrainerHook:
    """No-op base: override any of these."""

    def on_train_start(self, trainer: "RLTrainer", step: int) -> None:
        """After setup and resume, before the first step (`step` is the step resumed from)."""

    def on_batch(self, trainer: "RLTrainer", step: int, batch: "TensorDictBase") -> None:
        """With this rank's training batch, before advantages: add or reshape keys here
        (e.g. shaped rewards); the batch is modified in place."""

    def on_step_end(self, trainer: "RLTrainer", step: int, stats: dict[str, Any]) -> None:
        """After step `step` (1-based count of steps done) was trained, published and logged;
        `stats` is the record that was written (merged over ranks)."""

    def on_train_end(self, trainer: "RLTrainer", stats: dict[str, Any]) -> None:
        """After the last step and the final evaluation, before teardown."""


class CallbackHook(TrainerHook):
    """A hook from a plain function: ``CallbackHook(on_step_end=lambda trainer, step, stats: ...)``."""

    def __init__(self, **callbacks: Any):
        allowed = {n for n in vars(TrainerHook) if n.startswith("on_")}
        unknown = set(callbacks) - allowed
        if unknown:
            raise TypeError(f"unknown hook(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
        for name, fn in callbacks.items():
            setattr(self, name, fn)
