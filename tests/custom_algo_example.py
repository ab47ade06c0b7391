"""A user's own advantage estimator and policy loss, outside the arealite package.

tests/test_algo_registry.py names them in a YAML config as
``tests.custom_algo_example:<name>``, exactly as a user would name functions of
their own package. Each records its calls in ``CALLS`` so the test can see that
the trainer really used them.
"""

from __future__ import annotations

import torch

#: (function name, its first tensor's shape) of every call, in order.
CALLS: list[tuple[str, tuple[int, ...]]] = []

#: The fixed baseline of `baseline_advantages`.
BASELINE = 0.25


def baseline_advantages(rewards: torch.Tensor, group_id: torch.Tensor) -> torch.Tensor:
    """A fixed baseline instead of the group mean: ``r - 0.25`` (groups ignored)."""
    CALLS.append(("baseline_advantages", tuple(rewards.shape)))
    return rewards - BASELINE


def reinforce_loss(logp, prox_logp, advantages, loss_mask, behav_logp, config):
    """Vanilla REINFORCE, ``-A * logp`` per token: no ratio, no clipping, no behaviour weight."""
    CALLS.append(("reinforce_loss", tuple(logp.shape)))
    mask = loss_mask.bool()
    token_loss = torch.where(mask, -advantages * logp, torch.zeros_like(logp))
    n = mask.sum().clamp(min=1)
    return token_loss, {"reinforce_logp_mean": (logp.detach() * mask).sum() / n}


NOT_CALLABLE = 3
