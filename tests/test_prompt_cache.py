"""The embedded server's prompt cache as a data structure: LRU order, capacity, rows."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from arealite.server.prompt_cache import PromptCache, cached_row


def _entry(n: int):
    cache = DynamicCache()
    k = torch.arange(2 * 1 * 5 * 2, dtype=torch.float32).reshape(2, 1, 5, 2)
    cache.update(k, -k, 0)
    return cached_row(cache.layers, torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 1, n)


def test_a_row_keeps_its_last_tokens_as_copies():
    e = _entry(3)
    assert e.n_tokens == 3 and e.layers[0][0].shape == (1, 1, 3, 2)
    assert e.layers[0][0][0, 0].tolist() == [[14.0, 15.0], [16.0, 17.0], [18.0, 19.0]]
    assert torch.equal(e.layers[0][1], -e.layers[0][0]) and e.logits.tolist() == [3.0, 4.0]
    assert e.layers[0][0].untyped_storage().nbytes() == 3 * 2 * 4, "a copy, not a view of the batch"


def test_least_recently_used_goes_first():
    c = PromptCache(2)
    c.put(("a",), _entry(1))
    c.put(("b",), _entry(1))
    assert c.get(("a",)) is not None  # a is now the most recent
    c.put(("c",), _entry(1))
    assert c.get(("b",)) is None and c.get(("a",)) is not None and c.get(("c",)) is not None
    assert (c.hits, c.misses, len(c)) == (3, 1, 2)
    assert c.clear() == 2 and len(c) == 0


def test_capacity_zero_keeps_nothing_and_negative_is_refused():
    c = PromptCache(0)
    c.put(("a",), _entry(1))
    assert not c.enabled and len(c) == 0 and c.get(("a",)) is None
    with pytest.raises(ValueError, match="capacity -1"):
        PromptCache(-1)


def test_the_byte_limit_evicts_and_an_entry_over_it_is_not_kept():
    e = _entry(2)  # 1 layer of keys and values [1, 1, 2, 2] and 2 logits: 40 bytes
    assert e.nbytes == 40
    c = PromptCache(10, max_bytes=100)
    for k in "abc":
        c.put((k,), _entry(2))
    assert len(c) == 2 and c.nbytes == 80 and c.get(("a",)) is None, "the oldest goes over the byte limit"
    c.put(("b",), _entry(2))  # replacing an entry does not count it twice
    assert c.nbytes == 80
    small = PromptCache(10, max_bytes=30)
    small.put(("a",), _entry(2))
    assert len(small) == 0 and small.nbytes == 0
