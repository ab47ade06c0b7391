"""Rollout–train mismatch correction: truncated and masked importance sampling (TIS, MIS).

The inference engine and the trainer compute the log-probs of the same tokens under the
same weights differently (bf16 kernels, batch-dependent reductions, a different attention
implementation), so the tokens the server sampled come from a policy ``mu`` slightly off
the trainer's ``pi``. Left alone, the gradient is biased towards whatever the server
over-samples. With the trainer's log-probs of the batch (the proximal ``prox_logp`` of
decoupled PPO) and the server's (``behav_logp``), the importance weight of token t is

    w_t = pi(y_t) / mu(y_t) = exp(prox_logp_t - behav_logp_t)

and the per-token policy loss is multiplied by a bounded version of it:

- **TIS** (truncated IS; Yao, Liu et al. 2025, "Your efficient RL framework secretly
  brings you off-policy RL training"): ``min(w_t, C)``, or ``clamp(w_t, lower, upper)``
  with a lower bound too (two-sided);
- **MIS** (masked IS; Liu, Li et al. 2025, "When speed kills stability: demystifying RL
  collapse from the training-inference mismatch"): ``w_t`` where ``lower <= w_t <= upper``
  and the token left out of the loss elsewhere (its loss is 0, it still counts in the
  denominator).

At the *sequence* level both apply to the geometric mean of the sequence's weights,
``w_i = exp(mean_t log w_t)`` (length-normalised, so that long sequences are not
truncated or masked merely for being long), the same weight on every token of sequence i.

Logged every step (means over loss tokens; ``*_max`` are maxima): ``mismatch_kl_k3``, the
k3 estimate of KL(mu || pi), ``E_mu[w - 1 - log w]`` (>= 0); ``mismatch_ratio_max`` (the
largest token weight); ``mismatch_seq_ratio_max`` (sequence level); and the fraction of
tokens whose weight was changed: ``mismatch_truncated_frac`` (TIS) or
``mismatch_masked_frac`` (MIS).

In synchronous RL (staleness 0) ``prox_logp`` and ``behav_logp`` score the same policy
version and ``w`` measures the mismatch alone; with stale tokens it also carries the
version drift, which decoupled PPO corrects anyway (``behav_imp_weight_cap``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, NamedTuple

import torch

from arealite.algo.ratio import LOG_RATIO_CLAMP, clamped_exp, sequence_counts, sequence_index, sequence_mean

if TYPE_CHECKING:
    from arealite.config.schema import MismatchConfig

__all__ = ["MismatchMode", "MismatchLevel", "MismatchWeights", "mismatch_weights", "check_bounds",
           "behaviour_weight"]

MismatchMode = Literal["none", "tis", "mis"]
MismatchLevel = Literal["token", "sequence"]


class MismatchWeights(NamedTuple):
    """What the loss needs: which loss tokens stay, their weight (0 elsewhere), and stats."""

    keep: torch.Tensor  # bool, loss tokens left in the loss
    weight: torch.Tensor  # float32, the bounded importance weight on kept tokens, 0 elsewhere
    stats: dict[str, torch.Tensor]


def check_bounds(lower: float | None, upper: float) -> None:
    """``0 <= lower < 1 < upper``: a bound that excludes ``w = 1`` would correct a policy that
    has no mismatch at all."""
    if not upper > 1:
        raise ValueError(f"the upper bound of the mismatch weight must be > 1, got {upper}")
    if lower is not None and not 0 <= lower < 1:
        raise ValueError(f"the lower bound of the mismatch weight must be in [0, 1) (or None), got {lower}")


def mismatch_weights(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: MismatchMode = "tis",
    level: MismatchLevel = "token",
    upper: float = 2.0,
    lower: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> MismatchWeights:
    """The TIS or MIS weight of every loss token (no gradient flows through it).

    ``prox_logp``: the trainer's log-probs; ``behav_logp``: the server's; same shape,
    ``[T]`` packed (sequences from ``cu_seqlens``) or ``[B, L]``. ``lower`` None is
    one-sided (only ``upper`` bounds the weight). ``mode="none"`` gives the raw weight
    ``w`` on every loss token (stats only).
    """
    if mode not in ("none", "tis", "mis"):
        raise ValueError(f"unknown mismatch mode {mode!r}; choose none, tis or mis")
    if level not in ("token", "sequence"):
        raise ValueError(f"unknown mismatch level {level!r}; choose token or sequence")
    if prox_logp.shape != behav_logp.shape or loss_mask.shape != prox_logp.shape:
        raise ValueError(f"prox_logp {tuple(prox_logp.shape)}, behav_logp {tuple(behav_logp.shape)} and "
                         f"loss_mask {tuple(loss_mask.shape)} must share one shape")
    check_bounds(lower, upper)
    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=prox_logp.device)
    log_w = torch.where(mask, prox_logp.detach().float() - behav_logp.detach().float(), zero)
    log_w = log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_w = torch.exp(log_w)
    stats = {
        "mismatch_kl_k3": _masked_mean(token_w - 1 - log_w, mask),
        "mismatch_ratio_max": _masked_max(token_w, mask),
    }
    if level == "sequence":
        idx, n = sequence_index(mask, cu_seqlens)
        seq_w = torch.exp(sequence_mean(log_w, mask, idx, n))
        w = seq_w[idx]
        has_tokens = sequence_counts(mask, idx, n)[:n] > 0
        stats["mismatch_seq_ratio_max"] = seq_w[:n][has_tokens].max() if has_tokens.any() else zero.clone()
    else:
        w = token_w
    lo = 0.0 if lower is None else float(lower)
    outside = mask & ((w > upper) | (w < lo))
    if mode == "tis":
        keep, weight = mask, w.clamp(lo, upper)
        stats["mismatch_truncated_frac"] = _masked_mean(outside.float(), mask)
    elif mode == "mis":
        keep, weight = mask & ~outside, w
        stats["mismatch_masked_frac"] = _masked_mean(outside.float(), mask)
    else:
        keep, weight = mask, w
    return MismatchWeights(keep, torch.where(keep, weight, zero), stats)


def behaviour_weight(
    mask: torch.Tensor, prox: torch.Tensor, behav_logp: torch.Tensor, cap: float | None,
    stats: dict[str, torch.Tensor], mismatch: "MismatchConfig | None" = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled PPO's behaviour importance weight ``w = exp(prox - behav)``, with the
    mismatch correction on top: ``(tokens kept, weight on them, 0 elsewhere)``.

    Tokens with ``w > cap`` leave the loss; ``mismatch`` (``algorithm.mismatch``: TIS or
    MIS, `arealite.algo.mismatch`) then bounds or masks the weight of the others. The
    mismatch stats are logged whatever its mode.
    """
    zero = torch.zeros((), dtype=torch.float32, device=prox.device)
    behav_log_w = torch.where(mask, prox - behav_logp.detach().float(), zero)
    w = clamped_exp(behav_log_w)
    keep = mask & (w <= cap) if cap is not None else mask
    stats["imp_weight_mean"] = _masked_mean(w, mask)
    stats["imp_weight_max"] = _masked_max(w, mask)
    stats["imp_weight_capped_frac"] = _masked_mean((mask & ~keep).float(), mask)
    stats["approx_kl_behav"] = _masked_mean(-behav_log_w, mask)  # k1 of KL(behav || prox)
    m = mismatch_weights(prox, behav_logp, mask, getattr(mismatch, "mode", "none"),
                         getattr(mismatch, "level", "token"), getattr(mismatch, "upper", 2.0),
                         getattr(mismatch, "lower", None), cu_seqlens)
    stats.update(m.stats)
    keep = keep & m.keep
    # Zero the weight before multiplying: inf * 0 in the backward would be NaN.
    return keep, torch.where(keep, m.weight, zero)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum() / mask.sum().clamp(min=1)


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if not mask.any():
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return x[mask].max()
