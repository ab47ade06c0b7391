"""How a weight update is verified before generation continues on it.

A `WeightVerifier` sees the weights as the transfer reads them (`observe` wraps the
source; rank 0 only) and, once they are loaded, checks the servers (`verify`). The
default, `ReadbackVerifier`, keeps a reservoir sample of tensors and reads them back
with ``get_weights_by_name``. A model class without that route needs another check
(a log-prob probe, say); it is one more `WeightVerifier` given to the publisher.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from arealite.api.engine import WeightSource, WeightUpdateAdmin
from arealite.weight_sync.base import VERIFY_TRUNCATE, AdminCall, ReadbackSample, compare_readback

__all__ = ["ReadbackVerifier", "WeightVerifier"]

Buckets = Iterator[list[tuple[str, torch.Tensor]]]


class WeightVerifier(Protocol):
    """Checks, on rank 0, that the servers hold what the transfer sent."""

    def observe(self, source: WeightSource, version: int) -> WeightSource:
        """The source the transfer reads (it may watch the tensors go by, or be `source`)."""
        ...

    def verify(self, version: int, call: AdminCall) -> None:
        """Raise `WeightSyncError` unless every server holds ``version``'s weights.

        ``call(make_coro, what)`` runs an admin call on the servers in rotation, dropping
        the ones that are gone.
        """
        ...


class _Sampled:
    """A source that offers every tensor it yields to a fresh `ReadbackSample` per iteration."""

    def __init__(self, inner: WeightSource, k: int, version: int):
        self.inner, self.k, self.version = inner, k, version
        self.sample = ReadbackSample(k, version)

    def named_weight_buckets(self, bucket_bytes: int) -> Buckets:
        # A transfer that starts over (a server died mid-way) is sampled anew, as it sends anew.
        self.sample = sample = ReadbackSample(self.k, self.version)
        for bucket in self.inner.named_weight_buckets(bucket_bytes):
            for name, t in bucket:
                sample.offer(name, t)
            yield bucket


class ReadbackVerifier:
    """Reads ``n_tensors`` sampled tensors back from every server and compares them.

    ``dtype`` is the servers' weight dtype (it sets the tolerance), or a callable that
    returns it (a transfer may learn it only at ``init``).
    """

    def __init__(self, admin: WeightUpdateAdmin, n_tensors: int,
                 dtype: torch.dtype | None | Callable[[], torch.dtype | None] = None):
        self.admin = admin
        self.n_tensors = int(n_tensors)
        self._dtype = dtype
        self._watch: _Sampled | None = None

    @property
    def dtype(self) -> torch.dtype | None:
        return self._dtype() if callable(self._dtype) else self._dtype

    def observe(self, source: WeightSource, version: int) -> WeightSource:
        self._watch = _Sampled(source, self.n_tensors, version)
        return self._watch

    def verify(self, version: int, call: AdminCall) -> None:
        expected = self._watch.sample.expected if self._watch is not None else {}
        self._watch = None
        answers = {name: call(lambda n=name: self.admin.get_weights_by_name(n, VERIFY_TRUNCATE),
                              "get_weights_by_name") for name in expected}
        compare_readback(expected, answers, version, self.dtype)
