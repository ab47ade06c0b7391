"""Importance ratios that cannot overflow, and the sequence view of per-token tensors.

A ratio ``exp(logp - old_logp)`` overflows float32 once the log-ratio passes ~88; even
when the token's loss is clipped afterwards, the backward multiplies a zero upstream
gradient by ``inf`` and the whole step turns NaN. Every ratio in ``arealite.algo`` is
therefore ``exp(clamp(log_ratio, -20, 20))`` (as verl does): a token whose log-ratio
leaves that range is far outside any trust region, its gradient through the clamp is
0, and the loss stays finite.

Sequence-level quantities (GSPO's ratio, a sequence's geometric-mean mismatch weight)
need to know which token belongs to which sequence: the rows of a ``[B, L]`` tensor,
or the ``cu_seqlens`` boundaries of a packed ``[T]`` micro-batch.
"""

from __future__ import annotations

import torch

__all__ = ["LOG_RATIO_CLAMP", "clamped_exp", "sequence_index", "sequence_counts", "sequence_mean"]

#: Log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before ``exp`` (e^20 ~ 5e8).
LOG_RATIO_CLAMP = 20.0


def clamped_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """``exp(clamp(log_ratio, -20, 20))``: finite value and finite gradient whatever the input."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def sequence_index(mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """The sequence of every token (a long tensor shaped like ``mask``) and the number of sequences ``n``.

    ``[B, L]``: row ``b`` is sequence ``b``. Packed ``[T]``: ``cu_seqlens [n + 1]`` gives the
    boundaries; tokens after ``cu_seqlens[-1]`` (padding) get the dummy index ``n`` and must
    not be in ``mask``. Without ``cu_seqlens`` a ``[T]`` tensor is one sequence.
    """
    if mask.dim() == 2:
        B, L = mask.shape
        return torch.arange(B, device=mask.device)[:, None].expand(B, L), B
    if mask.dim() != 1:
        raise ValueError(f"expected [T] or [B, L] token tensors, got shape {tuple(mask.shape)}")
    T = mask.shape[0]
    if cu_seqlens is None:
        return torch.zeros(T, dtype=torch.long, device=mask.device), 1
    cu = cu_seqlens.long().to(mask.device)
    if cu.dim() != 1 or cu.numel() < 1 or cu[0] != 0 or (cu[1:] < cu[:-1]).any():
        raise ValueError(f"cu_seqlens must be a non-decreasing 1-D tensor starting at 0, got {cu_seqlens.tolist()}")
    end, n = int(cu[-1]), cu.numel() - 1
    if end > T:
        raise ValueError(f"cu_seqlens ends at {end} but there are only {T} tokens")
    if end < T and mask[end:].bool().any():
        raise ValueError(f"the mask marks tokens after the last sequence (cu_seqlens[-1]={end}, T={T})")
    idx = torch.repeat_interleave(torch.arange(n, device=mask.device), cu[1:] - cu[:-1])
    if end < T:
        idx = torch.cat([idx, torch.full((T - end,), n, dtype=idx.dtype, device=mask.device)])
    return idx, n


def sequence_mean(values: torch.Tensor, mask: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
    """Mean of ``values`` over each sequence's ``mask`` tokens: ``[n + 1]`` (the last entry is the
    padding dummy), 0 for a sequence without a masked token. Differentiable in ``values``."""
    mask = mask.bool()
    v = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device)).reshape(-1)
    flat = idx.reshape(-1)
    sums = torch.zeros(n + 1, dtype=v.dtype, device=v.device).index_add(0, flat, v)
    counts = torch.zeros(n + 1, dtype=v.dtype, device=v.device).index_add(0, flat, mask.reshape(-1).to(v.dtype))
    return sums / counts.clamp(min=1)


def sequence_counts(mask: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
    """How many ``mask`` tokens each sequence has: float ``[n + 1]`` (the last entry is the dummy)."""
    flat = mask.bool().reshape(-1).float()
    return torch.zeros(n + 1, dtype=torch.float32, device=mask.device).index_add(0, idx.reshape(-1), flat)
