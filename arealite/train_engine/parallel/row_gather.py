"""The rows a model-parallel group computes together: every rank's rows, gathered.

A caller hands each rank of the engine its own rows of a right-padded ``[B, L]`` batch, whatever
the parallel layout. The ranks of a sequence- or tensor-parallel group must compute the same
micro-batches, so each of them gathers the group's rows (in rank order, each rank's tensors
padded to the group's longest ``L`` once received); they then pack the same micro-batches, and
each keeps the per-token results of its own rows (`GroupRows.own`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["GroupRows", "gather_rows"]


@dataclass
class GroupRows:
    """The group's rows, and where this rank's are among them."""

    data: dict[str, torch.Tensor]
    """Every rank's rows, concatenated in rank order (``[B_group, L_group, ...]`` per token)."""
    start: int
    """This rank's first row in ``data``."""
    shape: tuple[int, int]
    """This rank's own ``(B, L)``."""

    def own(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a per-token result ``[B_group, L_group]``, as ``[B, L]``."""
        B, L = self.shape
        return values[self.start:self.start + B, :L]


def _padded(part: dict[str, torch.Tensor], to: int) -> dict[str, torch.Tensor]:
    """One rank's rows with their per-token tensors (``[B, L, ...]``) right-padded with zeros to ``to``."""
    B, L = part["input_ids"].shape
    out = {}
    for k, v in part.items():
        if v.dim() >= 2 and v.shape[:2] == (B, L) and to > L:
            v = F.pad(v, [0, 0] * (v.dim() - 2) + [0, to - L])
        out[k] = v
    return out


def gather_rows(data: dict[str, torch.Tensor], group: dist.ProcessGroup) -> GroupRows:
    """The rows of every rank of ``group`` (one collective over it: every rank calls it).

    Every rank must give the same keys; per-sequence tensors (``[B, ...]``) are concatenated
    as they are.
    """
    B, L = data["input_ids"].shape
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    parts: list[dict[str, torch.Tensor]] = [{}] * size  # filled by the collective
    dist.all_gather_object(parts, {k: v.detach().cpu() for k, v in data.items()}, group=group)
    keys = {tuple(sorted(p)) for p in parts}
    if len(keys) != 1:
        raise ValueError(f"the ranks of a model-parallel group were given batches with different keys: "
                         f"{sorted(keys)}; every rank must get the same fields")
    width = max(p["input_ids"].shape[1] for p in parts)
    parts = [_padded(p, width) for p in parts]
    device = data["input_ids"].device
    merged = {k: torch.cat([p[k] for p in parts]).to(device) for k in data}
    return GroupRows(merged, start=sum(p["input_ids"].shape[0] for p in parts[:rank]), shape=(B, L))
