"""How a weight update is verified.

A `WeightVerifier` may compute what it expects on every trainer rank before the
transfer (`prepare`: collectives allowed), sees the weights as the transfer reads them
(`observe` wraps the source; rank 0), checks the servers once the weights are loaded
and the servers still paused (`verify`), and once they generate again
(`check_serving`). Each check returns the figures it measured (logged with the step).

- `ReadbackVerifier` reads a reservoir sample of tensors back with
  ``get_weights_by_name``, on the servers whose model class can (SGLang answers 400
  "Get parameter by name failed" for others, e.g. Qwen2: those are skipped, said once).
- `LogprobProbe` (``probe.py``) works on every model: the servers score a fixed token
  sequence and the trainer's own forward of it must agree; it also measures the
  train/inference mismatch at every step.
- `Verifiers` runs several.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from arealite.api.contracts import WeightSource, WeightUpdateAdmin
from arealite.inference_client.errors import ServerAdminError
from arealite.inference_client.sglang_wire import READBACK_UNSUPPORTED
from arealite.weight_sync.base import VERIFY_TRUNCATE, AdminCall, ReadbackSample, compare_readback, logger

__all__ = ["ReadbackVerifier", "Verifiers", "WeightVerifier"]

Buckets = Iterator[list[tuple[str, torch.Tensor]]]


class WeightVerifier(Protocol):
    """Checks that the servers hold what the transfer sent (see the module's docstring)."""

    def prepare(self, version: int) -> None:
        """Every trainer rank, before the transfer: compute what the check expects."""
        ...

    def observe(self, source: WeightSource, version: int) -> WeightSource:
        """The source the transfer reads (it may watch the tensors go by, or be `source`)."""
        ...

    def verify(self, version: int, call: AdminCall) -> dict[str, float]:
        """Rank 0, servers paused: raise `WeightSyncError` unless every server holds
        ``version``'s weights; return what was measured.

        ``call(make_coro, what)`` runs an admin call on the servers in rotation, dropping
        the ones that are gone.
        """
        ...

    def check_serving(self, version: int, call: AdminCall) -> dict[str, float]:
        """Rank 0, servers generating again: the same, for checks that generate."""
        ...


class Verifiers:
    """Several verifiers, run in order; their figures are merged."""

    def __init__(self, *verifiers: WeightVerifier):
        self.verifiers = list(verifiers)

    def prepare(self, version: int) -> None:
        for v in self.verifiers:
            v.prepare(version)

    def observe(self, source: WeightSource, version: int) -> WeightSource:
        for v in self.verifiers:
            source = v.observe(source, version)
        return source

    def verify(self, version: int, call: AdminCall) -> dict[str, float]:
        return {k: x for v in self.verifiers for k, x in v.verify(version, call).items()}

    def check_serving(self, version: int, call: AdminCall) -> dict[str, float]:
        return {k: x for v in self.verifiers for k, x in v.check_serving(version, call).items()}


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
        self.unsupported: set[str] = set()  # servers whose model class cannot read weights back

    @property
    def dtype(self) -> torch.dtype | None:
        return self._dtype() if callable(self._dtype) else self._dtype

    def prepare(self, version: int) -> None:
        pass

    def observe(self, source: WeightSource, version: int) -> WeightSource:
        if self.n_tensors <= 0:
            return source
        self._watch = _Sampled(source, self.n_tensors, version)
        return self._watch

    def verify(self, version: int, call: AdminCall) -> dict[str, float]:
        expected = self._watch.sample.expected if self._watch is not None else {}
        self._watch = None
        if not expected or not set(self.admin.healthy_servers) - self.unsupported:
            return {}
        answers = {name: call(lambda n=name: self._read(n), "get_weights_by_name") for name in expected}
        if not any(answers.values()):  # no server in rotation can read back
            return {}
        compare_readback(expected, answers, version, self.dtype)
        return {"readback_tensors": float(len(expected))}

    def check_serving(self, version: int, call: AdminCall) -> dict[str, float]:
        return {}

    async def _read(self, name: str) -> dict:
        """The answers of the servers that can read back; the others are noted, once."""
        try:
            answers = await self.admin.get_weights_by_name(name, VERIFY_TRUNCATE)
        except ServerAdminError as e:
            cannot = {a for a, why in e.failures.items() if READBACK_UNSUPPORTED in str(why)}
            if not cannot or cannot != set(e.failures):
                raise
            new = sorted(cannot - self.unsupported)
            if new:
                logger.warning("%s cannot read weights back (%s: their model class lacks "
                               "get_weights_by_name); only the log-prob probe (weight_sync.probe) "
                               "verifies their weights",
                               ", ".join(new), READBACK_UNSUPPORTED)
            self.unsupported |= cannot
            answers = e.results
        return {a: v for a, v in answers.items() if a not in self.unsupported}
