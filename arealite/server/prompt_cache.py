"""The embedded server's prompt cache: the KV cache and last logits of recent prompts.

A GRPO group's samples share one prompt. When they cannot all join the running batch in
one admission (the batch has fewer free rows than the group has samples), each later
admission would run the same prompt through the model again. The cache keeps, per exact
prompt (and LoRA adapter), the prompt's per-layer keys and values and the logits of its
last position, so a later admission copies them instead of running a forward: the same
work SGLang's radix cache saves across batches (there by any shared prefix, here by whole
prompts only).

Entries are only valid for the weights that computed them: the runner clears the cache
whenever a command has run on its thread (weight loads, adapter changes and pauses all
arrive that way), and on ``/flush_cache``. Least recently used entries go first, when the
cache holds more than its number of prompts or more than ``max_bytes`` of tensors (a long
prompt of a large model holds hundreds of megabytes of KV).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class CachedPrompt:
    """One prompt's work: ``layers[i] = (keys, values)``, each ``[1, heads, len, head_dim]``
    without padding, and the logits of its last token ``[vocab]``."""

    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    logits: torch.Tensor

    @property
    def n_tokens(self) -> int:
        return int(self.layers[0][0].shape[2])

    @property
    def nbytes(self) -> int:
        return self.logits.nbytes + sum(k.nbytes + v.nbytes for k, v in self.layers)


#: Most bytes of keys, values and logits the cache holds by default.
DEFAULT_MAX_BYTES = 256 << 20


class PromptCache:
    """Least-recently-used map from (adapter, prompt ids) to a `CachedPrompt`, of at most
    ``capacity`` prompts and ``max_bytes`` bytes; capacity 0 keeps nothing."""

    def __init__(self, capacity: int, max_bytes: int = DEFAULT_MAX_BYTES):
        if capacity < 0:
            raise ValueError(f"prompt cache capacity {capacity} must be >= 0")
        self.capacity, self.max_bytes = capacity, max_bytes
        self._entries: OrderedDict[tuple, CachedPrompt] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def get(self, key: tuple) -> CachedPrompt | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: tuple, entry: CachedPrompt) -> None:
        """Keep ``entry`` (not when it alone is over ``max_bytes``), dropping the least recently used."""
        if not self.enabled or entry.nbytes > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self._entries[key] = entry
        self.nbytes += entry.nbytes
        while len(self._entries) > self.capacity or self.nbytes > self.max_bytes:
            self.nbytes -= self._entries.popitem(last=False)[1].nbytes

    def clear(self) -> int:
        """Drop every entry; returns how many there were."""
        n = len(self._entries)
        self._entries.clear()
        self.nbytes = 0
        return n


def cached_row(layers, logits: torch.Tensor, row: int, n_tokens: int) -> CachedPrompt:
    """Row ``row`` of a left-padded prefill (``layers``: the cache's layers, each with ``keys``
    and ``values [B, heads, T, head_dim]``; ``logits [B, vocab]``) as a `CachedPrompt` of its
    last ``n_tokens`` positions (copies, so that the batch's tensors can be freed)."""
    return CachedPrompt(
        layers=tuple((layer.keys[row:row + 1, :, -n_tokens:].clone(), layer.values[row:row + 1, :, -n_tokens:].clone())
                     for layer in layers),
        logits=logits[row].clone(),
    )


def stack_cached(entries: list[CachedPrompt], device: torch.device):
    """Entries as one left-padded batch: (``DynamicCache``, last logits ``[B, vocab]``,
    mask ``[B, T]``, lengths), the shapes of a prefill forward's results."""
    from transformers import DynamicCache

    lens = [e.n_tokens for e in entries]
    T = max(lens)
    cache = DynamicCache()
    for li in range(len(entries[0].layers)):
        keys = torch.cat([F.pad(e.layers[li][0], (0, 0, T - n, 0)) for e, n in zip(entries, lens)])
        values = torch.cat([F.pad(e.layers[li][1], (0, 0, T - n, 0)) for e, n in zip(entries, lens)])
        cache.update(keys, values, li)
    mask = torch.zeros((len(entries), T), dtype=torch.long, device=device)
    for i, n in enumerate(lens):
        mask[i, T - n:] = 1
    return cache, torch.stack([e.logits for e in entries]), mask, lens
