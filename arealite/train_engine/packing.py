"""Micro-batch splitting and sequence packing for the train engine.

A training batch arrives right-padded, ``[B, L]``. Computing on the padding is
waste, so the engine cuts the batch into micro-batches under a token budget and
concatenates the real tokens of each micro-batch into one row of ``T`` tokens
("packing"). Attention must not cross from one sequence into the next, so a
packed row comes with ``position_ids`` that restart at 0 per sequence and
``cu_seqlens`` boundaries, which the attention implementations of
``arealite.train_engine.attention`` use to run causal attention within each sequence.

Everything here is a pure function of tensors; the packed micro-batch layout
(``mb``) is the contract of docs/internals.md:

- ``labels[t] = input_ids[t + 1]`` within a sequence, so ``logits[t]`` predicts it;
- every other per-token key is shifted the same way (``mb[k][t]`` is the value at
  the position of ``labels[t]``); the last position of each sequence gets zeros,
  which makes ``loss_mask`` False there;
- per-sequence keys ``[n]`` are kept as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch


def split_into_microbatches(
    lengths: Sequence[int], max_tokens: int, min_count: int = 1
) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most ``max_tokens`` tokens.

    First-fit-decreasing: sequences are taken longest first and each goes into
    the first micro-batch with room. A sequence longer than the budget gets a
    micro-batch of its own. If fewer than ``min_count`` micro-batches result
    (ranks must agree on the count so that FSDP's collectives match), the
    fullest splittable micro-batch is halved until there are enough, and empty
    micro-batches are appended when no micro-batch holds two sequences.
    Every index appears exactly once.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1 (actor.mb_max_tokens)")
    if min_count < 0:
        raise ValueError(f"min_count={min_count} must be >= 0")
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"lengths[{i}]={n} is negative")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        n = lengths[i]
        for b, load in enumerate(loads):
            if load + n <= max_tokens:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    while len(bins) < min_count:
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        if not splittable:
            bins.extend([] for _ in range(min_count - len(bins)))
            break
        b = max(splittable, key=lambda k: loads[k])
        # Deal the (length-sorted) members alternately so both halves get a
        # similar number of tokens.
        first, second = bins[b][0::2], bins[b][1::2]
        bins[b] = first
        loads[b] = sum(lengths[i] for i in first)
        bins.append(second)
        loads.append(sum(lengths[i] for i in second))
    return bins


def sequence_lengths(attention_mask: torch.Tensor) -> torch.Tensor:
    """Real-token count of each row of a right-padded ``[B, L]`` attention mask.

    Raises if a row is not right-padded (a gap or left padding), because packing
    would silently mix padding into the sequence.
    """
    if attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be [B, L], got shape {tuple(attention_mask.shape)}"
        )
    am = attention_mask.bool()
    lengths = am.sum(dim=1)
    positions = torch.arange(am.shape[1], device=am.device)
    expected = positions[None, :] < lengths[:, None]
    bad = (am != expected).any(dim=1)
    if bad.any():
        row = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"attention_mask row {row} is not right-padded (real tokens must come first, "
            f"padding last); re-pad the batch to the right"
        )
    return lengths


@dataclass
class PackedIndex:
    """Where the tokens of a packed micro-batch came from (for ``unpack``)."""

    rows: list[int]
    """Batch row of each packed sequence, in packing order."""
    lengths: list[int]
    """Real length of each packed sequence."""

    @property
    def total_tokens(self) -> int:
        return int(sum(self.lengths))


def classify_keys(batch: Mapping[str, torch.Tensor], B: int, L: int) -> tuple[list[str], list[str]]:
    """Split batch keys into per-token (``[B, L, ...]``) and per-sequence (``[B, ...]``) keys."""
    per_token, per_seq = [], []
    for k, v in batch.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"batch key '{k}' is a {type(v).__name__}, expected a tensor")
        if v.dim() >= 2 and v.shape[0] == B and v.shape[1] == L:
            per_token.append(k)
        elif v.dim() >= 1 and v.shape[0] == B:
            per_seq.append(k)
        else:
            raise ValueError(
                f"batch key '{k}' has shape {tuple(v.shape)}; expected [B={B}, L={L}, ...] "
                f"(per token) or [B={B}, ...] (per sequence)"
            )
    return per_token, per_seq


def pack(
    batch: Mapping[str, torch.Tensor], rows: Sequence[int], lengths: Sequence[int] | torch.Tensor
) -> tuple[dict[str, torch.Tensor], PackedIndex]:
    """Concatenate the real tokens of ``rows`` of a right-padded batch into one micro-batch.

    Returns the ``mb`` dict of docs/internals.md (``input_ids``, ``position_ids``,
    ``cu_seqlens``, ``labels`` and every batch key shifted to line up with
    ``labels``) and the index needed to map per-token results back.
    """
    input_ids = batch["input_ids"]
    B, L = input_ids.shape
    per_token, per_seq = classify_keys(batch, B, L)
    rows = [int(r) for r in rows]
    lens = [int(lengths[r]) for r in rows]
    device = input_ids.device
    cu = torch.zeros(len(rows) + 1, dtype=torch.int32)
    if lens:
        cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0).to(torch.int32)
    # One gather per key instead of a slice per row: the flat [B*L] position of every
    # packed token, and whether it is the last of its sequence.
    pos = torch.arange(L, device=device)
    lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
    rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
    keep = pos[None, :] < lens_t[:, None]  # [R, L]
    flat = (rows_t[:, None] * L + pos[None, :])[keep]
    last = (pos[None, :] == (lens_t - 1)[:, None])[keep]
    # Shifted keys: position t holds the value of token t+1 of the same sequence, the
    # token logits[t] predicts. The last position of each sequence predicts nothing and
    # gets zeros (loss_mask False).
    nxt = (flat + 1).clamp_(max=max(B * L - 1, 0))
    mb: dict[str, torch.Tensor] = {"position_ids": pos[None, :].expand(len(rows), L)[keep], "cu_seqlens": cu.to(device)}
    for k in per_token + ["labels"]:
        v = batch["input_ids" if k == "labels" else k]
        v = v.reshape(B * L, *v.shape[2:])
        if k == "input_ids":
            mb[k] = v.index_select(0, flat)
            continue
        shifted = v.index_select(0, nxt)
        shifted[last] = 0
        mb[k] = shifted
    for k in per_seq:
        mb[k] = batch[k][rows] if rows else batch[k][:0]
    return mb, PackedIndex(rows=rows, lengths=lens)


def unpack(values: torch.Tensor, index: PackedIndex, out: torch.Tensor) -> torch.Tensor:
    """Write per-token results of a packed micro-batch back into ``out [B, L]``.

    ``values[t]`` scores ``labels[t]``, i.e. the token at the next position, so
    it lands at ``out[b, j + 1]``; position 0 of a sequence is left untouched
    (zero in a fresh ``out``), matching the trajectory's ``logprobs`` layout.
    """
    if values.dim() < 1 or values.shape[0] != index.total_tokens:
        raise ValueError(
            f"post_hook returned shape {tuple(values.shape)}; expected [T={index.total_tokens}] "
            f"(one value per packed token)"
        )
    B, L = out.shape[:2]
    lens = torch.tensor(index.lengths, dtype=torch.int64)
    rows = torch.tensor(index.rows, dtype=torch.int64)
    pos = torch.arange(L)
    # Every packed token but the last of its sequence: its value goes one position on.
    src_keep = pos[None, :] < (lens - 1)[:, None]
    target = (rows[:, None] * L + pos[None, :] + 1)[src_keep]
    starts = torch.cumsum(lens, 0) - lens
    src_idx = (starts[:, None] + pos[None, :])[src_keep]
    flat_out = out.view(B * L, *out.shape[2:])  # a fresh (contiguous) output, as the engine passes
    flat_out[target.to(out.device)] = values[src_idx.to(values.device)].to(out.dtype)
    return out
