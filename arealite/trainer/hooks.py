"""Hooks: where a user adds behaviour to the library loop without copying it.

Subclass `TrainerHook`, override the methods you need, and pass instances to
``RLTrainer(config, hooks=[...])``. Every trainer rank calls them with the trainer as a
`TrainerView` (what a hook may read of it); guard with ``trainer.rank == 0`` for work
that should happen once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from arealite.config.schema import ArealiteConfig
from arealite.utils.json_types import JsonObject

if TYPE_CHECKING:
    from tensordict import TensorDictBase


class TrainerView(Protocol):
    """What a hook may read of the trainer (`arealite.trainer.RLTrainer` is one)."""

    @property
    def config(self) -> ArealiteConfig:
        """The run's whole configuration."""

    @property
    def rank(self) -> int:
        """This trainer rank (0 ... world - 1)."""

    @property
    def world(self) -> int:
        """The number of trainer ranks."""

    @property
    def step(self) -> int:
        """Steps done (the step resumed from, before the first)."""

    @property
    def version(self) -> int:
        """The policy version the inference servers hold."""

    @property
    def total_steps(self) -> int:
        """The steps the run trains in all."""

    @property
    def out_dir(self) -> Path:
        """The run's directory (stats, checkpoints, exports)."""


class TrainerHook:
    """No-op base: override any of these."""

    def on_train_start(self, trainer: TrainerView, step: int) -> None:
        """After setup and resume, before the first step (`step` is the step resumed from)."""

    def on_batch(self, trainer: TrainerView, step: int, batch: TensorDictBase) -> None:
        """With this rank's training batch, before advantages: add or reshape keys here
        (e.g. shaped rewards); the batch is modified in place."""

    def on_step_end(self, trainer: TrainerView, step: int, stats: JsonObject) -> None:
        """After step `step` (1-based count of steps done) was trained, published and logged;
        `stats` is the record that was written (merged over ranks)."""

    def on_train_end(self, trainer: TrainerView, stats: JsonObject) -> None:
        """After the last step and the final evaluation, before teardown."""


class CallbackHook(TrainerHook):
    """A hook from a plain function: ``CallbackHook(on_step_end=lambda trainer, step, stats: ...)``."""

    def __init__(self, **callbacks: Callable[..., None]):
        allowed = {n for n in vars(TrainerHook) if n.startswith("on_")}
        unknown = set(callbacks) - allowed
        if unknown:
            raise TypeError(f"unknown hook(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
        for name, fn in callbacks.items():
            setattr(self, name, fn)
