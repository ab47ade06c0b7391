"""Evaluation on held-out prompts, each trainer rank taking its share.

The rollout side runs the episodes (`RolloutSide.eval_sums`: outside the training queue
and the staleness accounting, with the evaluation workflow, greedy and one sample per
prompt when built from config); the ranks' sums are added up here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from arealite.api.engine import RolloutSide


def evaluate(rollout: RolloutSide, items: Sequence[dict[str, Any]]) -> dict[str, float]:
    """``eval/accuracy`` (share of rows with reward > 0.5), ``eval/reward_mean`` and ``eval/n``,
    over every rank's share of `items` (a collective when several ranks train)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = list(items[rank::world])
    t = torch.tensor(rollout.eval_sums(mine) if mine else [0.0, 0.0, 0.0], dtype=torch.float64)
    if dist.is_initialized() and world > 1:
        dist.all_reduce(t)
    correct, n, reward = t.tolist()
    return {"eval/accuracy": correct / n if n else 0.0, "eval/reward_mean": reward / n if n else 0.0,
            "eval/n": n}
