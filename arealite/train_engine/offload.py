"""A train engine's state leaves the device between steps and comes back: `EngineOffload`.

The time-shared placement (`launch.placement: colocated`) hands every GPU to the inference
servers while they generate. Meanwhile the trainer's parameters, gradients and optimizer
state wait in host memory (pinned on CUDA, so the copies back run at full bus speed).

Offloading frees each tensor's *storage* in place (``untyped_storage().resize_(0)``) rather
than moving the module (``model.to("cpu")``): the `Parameter` objects, the FSDP2 shards'
views and the optimizer's state keys stay the same Python objects, so nothing that holds a
reference to them (FSDP2's parameter records, the optimizer, the LR schedule) notices. On
the CPU the same code frees the engine's own storages (the host copy is then the only
one), which is what the tests measure.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from arealite.utils.storage import FreedStorages, distinct_storages

__all__ = ["EngineOffload", "engine_tensors", "storage_bytes"]

logger = logging.getLogger("arealite.train_engine")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's data (a DTensor's local shard)."""
    to_local = getattr(t, "to_local", None)
    return (to_local() if callable(to_local) else t).detach()


def engine_tensors(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> Iterator[torch.Tensor]:
    """Every tensor an engine keeps between steps: parameters, gradients, optimizer state."""
    if model is not None:
        for p in model.parameters():
            yield _local(p)
            if p.grad is not None:
                yield _local(p.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    yield _local(v)


def storage_bytes(tensors: Iterator[torch.Tensor]) -> int:
    """Bytes the distinct storages behind ``tensors`` hold now (0 for a freed storage)."""
    return sum(st.nbytes() for st in distinct_storages(tensors))


@dataclass
class _Parked:
    """One tensor whose storage was freed, and the host copy of its bytes."""

    tensor: torch.Tensor
    host: torch.Tensor


class EngineOffload:
    """Moves an engine's state (its public ``model`` and ``optimizer``) to host memory and back.

    ``offload()`` copies every parameter, gradient and optimizer-state tensor to a host
    buffer (pinned when the engine computes on CUDA; the buffers are kept and reused
    every step) and frees the device storage; ``onload()`` restores the storage and copies
    the bytes back, bit for bit. Both return the seconds they took. Calling either twice
    in a row is a no-op (the state is where it was asked to be).
    """

    def __init__(self, engine: object):
        self.engine = engine
        self._parked: list[_Parked] = []
        self._freed = FreedStorages()
        self._host: dict[tuple[int, tuple[int, ...], torch.dtype], torch.Tensor] = {}
        self.offloaded = False

    def _tensors(self) -> Iterator[torch.Tensor]:
        return engine_tensors(getattr(self.engine, "model", None), getattr(self.engine, "optimizer", None))

    def device_bytes(self) -> int:
        """Bytes the engine's state holds in its own storages now."""
        return storage_bytes(self._tensors())

    def offload(self) -> float:
        """Park the state in host memory and free its storages; returns the seconds taken."""
        if self.offloaded:
            return 0.0
        t0 = time.perf_counter()
        _reshard(getattr(self.engine, "model", None))  # gathered copies (the root's) are freed too
        for i, t in enumerate(self._tensors()):
            if t.untyped_storage().nbytes() == 0:
                continue
            host = self._host_buffer(i, t)
            host.copy_(t, non_blocking=t.is_cuda)
            self._parked.append(_Parked(t, host))
        if any(p.tensor.is_cuda for p in self._parked):
            torch.cuda.synchronize()  # the copies must land before the storage goes
        # Several views may share one storage (FSDP2's padded shard): it is freed once.
        self._freed.free(distinct_storages(p.tensor for p in self._parked))
        self.offloaded = True
        return time.perf_counter() - t0

    def _host_buffer(self, i: int, t: torch.Tensor) -> torch.Tensor:
        key = (i, tuple(t.shape), t.dtype)
        buf = self._host.get(key)
        if buf is None:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            self._host[key] = buf
        return buf

    def onload(self) -> float:
        """Restore every storage and copy the parked bytes back; returns the seconds taken."""
        if not self.offloaded:
            return 0.0
        t0 = time.perf_counter()
        self._freed.regrow()
        with torch.no_grad():
            for p in self._parked:
                p.tensor.copy_(p.host, non_blocking=p.tensor.is_cuda)
        if any(p.tensor.is_cuda for p in self._parked):
            torch.cuda.synchronize()
        self._parked = []
        self.offloaded = False
        return time.perf_counter() - t0


def _reshard(model: torch.nn.Module | None) -> None:
    """Free FSDP2's gathered parameters (the root keeps its own after a forward)."""
    if model is None:
        return
    for m in model.modules():
        reshard = getattr(m, "reshard", None)
        if callable(reshard) and type(m).__name__.startswith("FSDP"):
            reshard()
