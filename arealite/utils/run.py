"""Small pieces a training script needs: run directory, server addresses, batch stats,
greedy evaluation, and stats reduced over trainer ranks.

They live here so that ``examples/*/train.py`` reads as the algorithm alone.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from arealite.config.schema import ArealiteConfig
from arealite.rollout.staleness import trajectory_staleness

ENV_SERVER_ADDRS = "AREALITE_SERVER_ADDRS"
ENV_SERVER_API_KEY = "AREALITE_SERVER_API_KEY"
#: Cores for the trainers' rollout workers (comma-separated); the launcher sets the servers' cores.
ENV_ROLLOUT_CPUS = "AREALITE_ROLLOUT_CPUS"


def run_dir(cfg: ArealiteConfig) -> Path:
    """``<output_root>/<name>/<trial>``: logs, stats, checkpoints and plots of a run."""
    e = cfg.experiment
    return Path(e.output_root) / e.name / e.trial


def server_addrs(cfg: ArealiteConfig) -> list[str]:
    """Inference servers: the launcher's environment variable, else ``launch.server_addrs``."""
    env = os.environ.get(ENV_SERVER_ADDRS, "")
    addrs = [a.strip() for a in env.split(",") if a.strip()] or list(cfg.launch.server_addrs)
    if not addrs:
        raise RuntimeError(
            f"no inference server address: run under `python -m arealite.launcher.local`, or set "
            f"{ENV_SERVER_ADDRS}=host:port[,host:port...] or launch.server_addrs"
        )
    return addrs


def server_api_key(cfg: ArealiteConfig) -> str | None:
    return os.environ.get(ENV_SERVER_API_KEY) or cfg.server.api_key


def batch_stats(batch, version: int) -> dict[str, float]:
    """Reward, length and staleness figures of one training batch (this rank's rows)."""
    rewards = batch["rewards"].float()
    lm = batch["loss_mask"].bool()
    resp_len = lm.sum(-1).float()
    staleness = trajectory_staleness(batch["versions"], lm, version)
    out = {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        "rollout/accuracy": (rewards > 0.5).float().mean().item(),
        "rollout/response_len_mean": resp_len.mean().item(),
        "rollout/response_len_max": resp_len.max().item(),
        "rollout/n_trajectories": float(rewards.numel()),
        "rollout/n_tokens": float(batch["attention_mask"].sum().item()),
        "rollout/staleness_mean": staleness.float().mean().item(),
        "rollout/staleness_max": staleness.max().item(),
    }
    for s, n in sorted(collections.Counter(staleness.tolist()).items()):
        out[f"rollout/staleness_hist/{int(s)}"] = float(n)
    return out


def reduce_stats(stats: Mapping[str, float], sum_keys: Sequence[str] = ()) -> dict[str, float]:
    """Merge every rank's stats (a collective): ``*_max`` keys take the max, ``sum_keys``,
    counts and histogram buckets the sum, lists are concatenated in rank order, the rest
    is averaged. Ranks may hold different keys (histogram buckets differ)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(stats)
    gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, dict(stats))
    keys = sorted({k for g in gathered for k in g})
    out: dict[str, float] = {}
    for k in keys:
        lists = [g[k] for g in gathered if isinstance(g.get(k), list)]
        if lists:  # per-rank lists (e.g. prompt ids): concatenated in rank order
            out[k] = [x for lst in lists for x in lst]
            continue
        vals = [float(g[k]) for g in gathered if k in g and isinstance(g[k], (int, float))]
        if not vals:
            continue
        if k.endswith("_max"):
            out[k] = max(vals)
        elif k in sum_keys or "/staleness_hist/" in k or k.startswith("rollout/n_"):
            out[k] = sum(vals)
        else:
            out[k] = sum(vals) / len(vals)
    return out


def evaluate(controller, items: Sequence[dict[str, Any]], workflow, max_concurrency: int = 64) -> dict[str, float]:
    """Greedy accuracy on held-out items, each trainer rank taking its share.

    Episodes run directly on the controller's engine (its event loop), outside
    the training queue and the staleness accounting. ``workflow`` should sample
    greedily (a per-call override: ``GenerationConfig(n_samples=1, greedy=True)``).
    """
    import asyncio

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = list(items[rank::world])

    async def _all() -> list:
        sem = asyncio.Semaphore(max_concurrency)

        async def one(item):
            async with sem:
                return await workflow.arun_episode(controller.engine, item)

        return await asyncio.gather(*(one(it) for it in mine))

    correct = total = 0.0
    for td in controller.run(_all()) if mine else []:
        if td is not None:
            correct += float((td["rewards"] > 0.5).sum().item())
            total += float(td["rewards"].numel())
    t = torch.tensor([correct, total], dtype=torch.float64)
    if dist.is_initialized() and world > 1:
        dist.all_reduce(t)
    return {"eval/accuracy": (t[0] / t[1]).item() if t[1] > 0 else 0.0, "eval/n": t[1].item()}
