"""Evaluation on held-out prompts, each trainer rank taking its share.

Episodes run directly on the controller's inference client (its event loop), outside
the training queue and the staleness accounting, with the evaluation workflow (greedy,
one sample per prompt when built from config).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from arealite.rollout.controller import RolloutController
from arealite.workflow.base import RolloutWorkflow


def evaluate(controller: RolloutController, items: Sequence[dict[str, Any]], workflow: RolloutWorkflow,
             max_concurrency: int = 64) -> dict[str, float]:
    """``eval/accuracy`` (share of rows with reward > 0.5), ``eval/reward_mean`` and ``eval/n``,
    over every rank's share of `items` (a collective when several ranks train)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = list(items[rank::world])

    async def run_all() -> list:
        sem = asyncio.Semaphore(max_concurrency)

        async def one(item):
            async with sem:
                return await workflow.arun_episode(controller.engine, item)

        return await asyncio.gather(*(one(it) for it in mine))

    correct = total = reward = 0.0
    for td in controller.run(run_all()) if mine else []:
        if td is not None:
            rewards = td["rewards"].float()
            correct += float((rewards > 0.5).sum().item())
            reward += float(rewards.sum().item())
            total += float(rewards.numel())
    t = torch.tensor([correct, total, reward], dtype=torch.float64)
    if dist.is_initialized() and world > 1:
        dist.all_reduce(t)
    n = t[1].item()
    return {"eval/accuracy": t[0].item() / n if n else 0.0,
            "eval/reward_mean": t[2].item() / n if n else 0.0, "eval/n": n}
