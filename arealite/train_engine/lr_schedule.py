"""Learning-rate schedules: linear warmup, then constant, linear or cosine decay.

``lr_factor`` is a pure function of the step (the multiplier of the peak LR),
so it can be tested and plotted alone; ``build_lr_scheduler`` wraps it in a
``LambdaLR`` whose state (the step) goes into checkpoints.
"""

from __future__ import annotations

import math

import torch

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(
    step: int,
    kind: str,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based).

    Warmup: steps ``0 .. warmup_steps - 1`` rise linearly to the peak, reaching
    it at the last warmup step (the first step does not waste an update at LR 0).
    After warmup, ``linear``/``cosine`` decay from 1 to ``min_lr_ratio`` at step
    ``total_steps - 1`` and stay there; ``constant`` stays at 1.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"lr_scheduler={kind!r} is not one of {SCHEDULES}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    if total_steps is None:
        raise ValueError(
            f"lr_scheduler={kind!r} needs optimizer.total_steps; set actor.optimizer.total_steps "
            f"or pass total_steps to FSDPEngine.initialize()"
        )
    decay_steps = max(1, total_steps - 1 - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / decay_steps))
    if kind == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    kind: str,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` following ``lr_factor``; call ``step()`` after each optimizer step."""
    # Validate now rather than at the first decay step.
    lr_factor(warmup_steps, kind, warmup_steps, total_steps, min_lr_ratio)
    if total_steps is not None and total_steps <= warmup_steps and kind != "constant":
        raise ValueError(
            f"optimizer.total_steps={total_steps} must exceed optimizer.warmup_steps={warmup_steps}"
        )
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(step, kind, warmup_steps, total_steps, min_lr_ratio),
    )
