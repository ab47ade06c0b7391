"""Scores of sampled answers: pass@k and the sums evaluation adds up over prompts and ranks.

pass@k is the probability that at least one of k answers drawn without replacement from
the n sampled for a prompt is correct. With c correct among n, its unbiased estimate is
(Chen et al., 2021, "Evaluating large language models trained on code", arXiv:2107.03374)

    pass@k = 1 - C(n - c, k) / C(n, k)          (1 when n - c < k)

averaged over prompts. mean@k is the plain accuracy of the k sampled answers (their mean
correctness), averaged over prompts: the expected pass@1 at that temperature.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tensordict import TensorDictBase

__all__ = ["pass_at_k", "eval_ks", "episode_scores"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct answers among ``n`` (``1 <= k <= n``)."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"correct answers c={c} must be in [0, n={n}]")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_ks(n: int) -> list[int]:
    """The k reported for ``n`` samples per prompt: 1, 2, 4, ... below ``n``, and ``n``."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def episode_scores(groups: Sequence[TensorDictBase | None], ks: Sequence[int] = ()) -> dict[str, float]:
    """Sums over evaluated prompts (each a trajectory group, ``None`` if rejected): ``correct``
    (rows with reward > 0.5), ``n`` (rows), ``reward``, ``length`` (policy tokens),
    ``truncated`` (rows cut at the length limit, from the workflow's ``truncated`` flag),
    ``prompts``, and ``pass@k`` (the sum of each prompt's pass@k) for every k in ``ks``
    that its group can estimate (a smaller group adds to ``pass@k_skipped``)."""
    out = {"correct": 0.0, "n": 0.0, "reward": 0.0, "length": 0.0, "truncated": 0.0, "prompts": 0.0}
    for k in ks:
        out[f"pass@{k}"] = 0.0
        out[f"pass@{k}_skipped"] = 0.0
    for td in groups:
        if td is None:
            continue
        rewards = td["rewards"].float()
        n, c = rewards.numel(), int((rewards > 0.5).sum())
        out["correct"] += c
        out["n"] += n
        out["reward"] += float(rewards.sum())
        out["length"] += float(td["loss_mask"].bool().sum()) if "loss_mask" in td.keys() else 0.0
        if "truncated" in td.keys():
            out["truncated"] += float(torch.as_tensor(td["truncated"]).bool().sum())
        out["prompts"] += 1
        for k in ks:
            if k <= n:
                out[f"pass@{k}"] += pass_at_k(n, c, k)
            else:
                out[f"pass@{k}_skipped"] += 1
    return out
