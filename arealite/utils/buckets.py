"""Grouping named tensors into size-bounded buckets (weight export and weight sync)."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch


def buckets_of(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
               ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs, lazily, into buckets of at most ``bucket_bytes``
    (a larger tensor is a bucket of its own)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket
