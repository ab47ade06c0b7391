"""GSPO: Group Sequence Policy Optimization (Zheng et al., 2025, arXiv:2507.18071).

PPO/GRPO weight every token by its own ratio ``pi(y_t) / pi_old(y_t)``, although the
reward (and so the advantage) belongs to the whole sequence; the token ratios are noisy
and their clipping acts token by token. GSPO uses one ratio per sequence, the
length-normalised likelihood ratio (the geometric mean of the token ratios)

    s_i = (pi(y_i | x) / pi_old(y_i | x)) ^ (1 / |y_i|) = exp( mean_t [log pi(y_t) - log pi_old(y_t)] )

and clips it at the sequence level:

    J_GSPO = E[ 1/G sum_i min( s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i ) ].

Since ``s_i`` is a geometric mean it stays close to 1: the paper clips at
``eps_low = 3e-4, eps_high = 4e-4`` (set ``algorithm.eps_clip`` and ``eps_clip_high``).

**GSPO-token** lets the advantage vary along the sequence (token-level advantages, e.g.
from GAE or a KL penalty in the reward) while keeping GSPO's sequence ratio as the value:

    s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]
    J = E[ 1/G sum_i 1/|y_i| sum_t min( s_{i,t} A_{i,t}, clip(s_{i,t}) A_{i,t} ) ]

(``sg`` stops the gradient). With ``A_{i,t} = A_i`` it has GSPO's value and gradient.

Here the sequence objective is written per token: every loss token of sequence i carries
``-min(s A, clip(s) A)``; aggregated with ``loss_agg_mode: seq-mean-token-mean`` that is
exactly ``-J`` (token-mean weights sequences by length instead). The plain GSPO loss takes
the sequence's advantage as the mean of its tokens' advantages. With decoupled PPO,
``pi_old`` is the proximal policy and each token is weighted by the behaviour importance
weight (capped; with the mismatch correction), as in ``ppo_policy_loss``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from arealite.algo.loss import masked_mean, policy_loss
from arealite.algo.mismatch import behaviour_weight
from arealite.algo.ratio import clamped_exp, sequence_counts, sequence_index, sequence_mean

if TYPE_CHECKING:
    from arealite.config.schema import AlgorithmConfig, MismatchConfig

__all__ = ["gspo_policy_loss", "gspo_loss", "gspo_token_loss"]


def gspo_policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float = 3e-4,
    eps_clip_high: float | None = 4e-4,
    token_level: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    behav_logp: torch.Tensor | None = None,
    behav_imp_weight_cap: float | None = None,
    mismatch: "MismatchConfig | None" = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token GSPO loss (``token_level``: GSPO-token), 0 outside ``loss_mask``, and stats.

    Tensors ``[T]`` packed (sequences from ``cu_seqlens``; without it, one sequence) or
    ``[B, L]`` (a sequence per row). Stats: ``clip_frac_low``/``clip_frac_high`` (over loss
    tokens, a clipped sequence counting with its tokens), ``seq_ratio_mean``,
    ``seq_ratio_max``, ``approx_kl_prox`` and, decoupled, the behaviour-weight stats.
    """
    if not (logp.shape == prox_logp.shape == advantages.shape == loss_mask.shape):
        raise ValueError(f"gspo_policy_loss needs tensors of one shape, got logp {tuple(logp.shape)}, prox_logp "
                         f"{tuple(prox_logp.shape)}, advantages {tuple(advantages.shape)}, "
                         f"loss_mask {tuple(loss_mask.shape)}")
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    if eps_clip <= 0 or eps_high <= 0:
        raise ValueError(f"GSPO clip ranges must be > 0, got eps_clip={eps_clip}, eps_clip_high={eps_clip_high}")
    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    idx, n = sequence_index(mask, cu_seqlens)
    logp = logp.float()
    prox = prox_logp.detach().float()
    log_ratio = torch.where(mask, logp - prox, zero)
    seq_ratio = clamped_exp(sequence_mean(log_ratio, mask, idx, n))  # [n + 1], differentiable
    if token_level:
        # sg[s_i] * pi(y_t) / sg[pi(y_t)]: the value of s_i, the gradient of log pi(y_t).
        ratio = seq_ratio.detach()[idx] * torch.exp(torch.where(mask, logp - logp.detach(), zero))
        adv = torch.where(mask, advantages.float(), zero)
    else:
        ratio = seq_ratio[idx]
        adv = sequence_mean(advantages.float(), mask, idx, n)[idx]
    stats: dict[str, torch.Tensor] = {}
    keep, w_kept = mask, None
    if behav_logp is not None:
        keep, w_kept = behaviour_weight(mask, prox, behav_logp, behav_imp_weight_cap, stats, mismatch, cu_seqlens)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    clip_used = (pg_clipped > pg_unclipped) & keep
    with torch.no_grad():
        r = ratio.detach()
        stats["clip_frac_low"] = masked_mean((clip_used & (r < 1)).float(), mask)
        stats["clip_frac_high"] = masked_mean((clip_used & (r > 1)).float(), mask)
        has_tokens = sequence_counts(mask, idx, n)[:n] > 0
        seq_r = seq_ratio.detach()[:n][has_tokens]
        stats["seq_ratio_mean"] = seq_r.mean() if seq_r.numel() else zero + 1.0
        stats["seq_ratio_max"] = seq_r.max() if seq_r.numel() else zero + 1.0
        stats["approx_kl_prox"] = masked_mean(-log_ratio.detach(), mask)
    if w_kept is not None:
        pg = pg * w_kept
    return torch.where(keep, pg, zero), stats


def _from_config(logp, prox_logp, advantages, loss_mask, behav_logp, config, cu_seqlens, token_level):
    return gspo_policy_loss(
        logp, prox_logp, advantages, loss_mask, eps_clip=config.eps_clip, eps_clip_high=config.eps_clip_high,
        token_level=token_level, cu_seqlens=cu_seqlens, behav_logp=behav_logp,
        behav_imp_weight_cap=config.behav_imp_weight_cap, mismatch=config.mismatch,
    )


@policy_loss("gspo")
def gspo_loss(logp: torch.Tensor, prox_logp: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
              behav_logp: torch.Tensor | None, config: "AlgorithmConfig", *,
              cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (sequence ratio, sequence advantage) with ``algorithm.eps_clip``/``eps_clip_high``."""
    return _from_config(logp, prox_logp, advantages, loss_mask, behav_logp, config, cu_seqlens, False)


@policy_loss("gspo_token")
def gspo_token_loss(logp: torch.Tensor, prox_logp: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
                    behav_logp: torch.Tensor | None, config: "AlgorithmConfig", *,
                    cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token (sequence ratio as value, token advantages) with ``algorithm.eps_clip``/``eps_clip_high``."""
    return _from_config(logp, prox_logp, advantages, loss_mask, behav_logp, config, cu_seqlens, True)
