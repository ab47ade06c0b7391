"""Overlong responses (DAPO; Yu et al., 2025, arXiv:2503.14476, section 3.4).

A response cut off at the length limit ``L_max`` (``generation.max_new_tokens``) has no
final answer, so a 0 reward punishes a possibly sound chain of thought for its length
alone: reward noise. DAPO offers two remedies; either or both may be on.

**Soft overlong punishment** (``algorithm.overlong.buffer_len`` = ``L_cache``): a length
penalty ramps from 0 to -1 over the last ``L_cache`` tokens before the limit and is
added to the task reward,

    R_len(y) = 0                                  if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
             = -1                                 if |y| > L_max

times ``algorithm.overlong.penalty_factor``.

**Overlong filtering** (``algorithm.overlong.exclude_truncated``): truncated samples
are left out of the loss altogether (their tokens leave ``loss_mask``), so they neither
push nor count in the average. They still count in their group's baseline.
"""

from __future__ import annotations

import torch

__all__ = ["soft_overlong_penalty", "truncated_rows", "exclude_rows"]


def soft_overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's ``R_len`` of each response length ``[B]`` (float32, in [-factor, 0])."""
    if max_len <= 0:
        raise ValueError(f"max_len must be > 0, got {max_len}")
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"the overlong buffer must be in (0, max_len={max_len}], got {buffer_len}")
    if factor < 0:
        raise ValueError(f"the overlong penalty factor must be >= 0, got {factor}")
    n = lengths.float()
    start = float(max_len - buffer_len)
    ramp = (start - n) / float(buffer_len)
    pen = torch.where(n <= start, torch.zeros_like(n), torch.where(n <= max_len, ramp, -torch.ones_like(n)))
    return pen * factor


def truncated_rows(loss_mask: torch.Tensor, max_len: int, truncated: torch.Tensor | None = None) -> torch.Tensor:
    """Which trajectories ``[B]`` (bool) were cut at the length limit.

    ``truncated`` (the workflow's own flag, from the finish reason ``length``) wins when
    given; otherwise a response of ``max_len`` or more policy tokens counts as truncated
    (exact for single-turn samples unless the EOS token falls exactly on the last slot).
    """
    if truncated is not None:
        if truncated.shape != loss_mask.shape[:1]:
            raise ValueError(f"'truncated' must be [B={loss_mask.shape[0]}], got {tuple(truncated.shape)}")
        return truncated.bool()
    return loss_mask.bool().sum(-1) >= max_len


def exclude_rows(loss_mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``loss_mask [B, L]`` with the rows where ``rows [B]`` is true cleared."""
    return loss_mask.bool() & ~rows.bool()[:, None]
