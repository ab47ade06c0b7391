"""Evaluation on held-out prompts, each trainer rank taking its share.

The rollout side runs the episodes (`RolloutSide.eval_sums`: outside the training queue
and the staleness accounting): the greedy evaluation workflow (one answer per prompt when
built from config) and, with `evaluation.n_samples` > 1, the sampled one
(`evaluation.n_samples` answers at `evaluation.temperature`, for pass@k and mean@k). The
ranks' sums are added up here (`arealite.reward.metrics`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from arealite.algo.returns import collective_device
from arealite.api.contracts import RolloutSide
from arealite.reward.metrics import eval_ks
from arealite.utils.json_types import JsonObject

__all__ = ["evaluate"]


def _summed(rollout: RolloutSide, items: Sequence[JsonObject], ks: Sequence[int]) -> dict[str, float]:
    """``eval_sums`` of this rank's share of ``items``, summed over ranks (a collective)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    mine = list(items[rank::world])
    sums = rollout.eval_sums(mine, ks) if ks else rollout.eval_sums(mine)
    if dist.is_initialized() and world > 1:
        # Every rank has the same keys (the same ks), even with an empty share.
        keys = sorted(sums) if mine else None
        gathered: list[list[str] | None] = [None] * world
        dist.all_gather_object(gathered, keys)
        keys = next(k for k in gathered if k is not None)
        t = torch.tensor([float(sums.get(k, 0.0)) for k in keys], dtype=torch.float64, device=collective_device())
        dist.all_reduce(t)
        sums = dict(zip(keys, t.cpu().tolist()))
    return sums


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def evaluate(rollout: RolloutSide, items: Sequence[JsonObject], n_samples: int = 1) -> dict[str, float]:
    """Held-out figures over every rank's share of ``items`` (collective when several ranks train).

    Greedy: ``eval/accuracy`` (share of answers with reward > 0.5), ``eval/reward_mean``,
    ``eval/n``, ``eval/truncated_frac`` and ``eval/response_len_mean``. With ``n_samples`` > 1
    also ``eval/pass@k`` for k = 1, 2, 4, ..., n_samples, ``eval/mean@<n_samples>`` and the
    sampled answers' ``eval/sampled_truncated_frac`` and ``eval/sampled_response_len_mean``.
    """
    s = _summed(rollout, items, ())
    n = s.get("n", 0.0)
    out = {"eval/accuracy": _ratio(s.get("correct", 0.0), n), "eval/reward_mean": _ratio(s.get("reward", 0.0), n),
           "eval/n": n, "eval/truncated_frac": _ratio(s.get("truncated", 0.0), n),
           "eval/response_len_mean": _ratio(s.get("length", 0.0), n)}
    if n_samples > 1:
        ks = eval_ks(n_samples)
        t = _summed(rollout, items, ks)
        m, prompts = t.get("n", 0.0), t.get("prompts", 0.0)
        for k in ks:
            out[f"eval/pass@{k}"] = _ratio(t.get(f"pass@{k}", 0.0), prompts - t.get(f"pass@{k}_skipped", 0.0))
        out[f"eval/mean@{n_samples}"] = _ratio(t.get("correct", 0.0), m)
        out["eval/sampled_truncated_frac"] = _ratio(t.get("truncated", 0.0), m)
        out["eval/sampled_response_len_mean"] = _ratio(t.get("length", 0.0), m)
    return out
