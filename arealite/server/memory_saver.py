"""Giving a served model's memory back and taking it again: what SGLang's memory saver does.

SGLang (``--enable-memory-saver``) allocates its weights and KV cache through
torch_memory_saver, which can unmap a region's physical memory while its virtual
addresses stay valid (``utils/torch_memory_saver_adapter.py``). Released weights lose
their contents unless the server runs with ``--enable-weights-cpu-backup`` (then they are
copied to host memory first); on resume they get fresh memory at the same addresses, so
the trainer pushes weights before the next generation. Buffers (SGLang's "static state":
rotary tables and the like) are stashed and restored either way.

The embedded server does the same with PyTorch's own means: each parameter storage is
resized to zero bytes (the allocator frees it; ``malloc_trim`` hands freed heap pages
back to the system on Linux) and resized back on resume, so every tensor object, tied
weight and view the model holds stays valid. Without a backup the resumed weights are
zeros (SGLang's are undefined); with one they are copied back. On a CPU device the
backup would be a second copy in the same memory, so there a backup keeps the weights
where they are and frees nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import torch

from arealite.utils.storage import FreedStorages, distinct_storages

logger = logging.getLogger("arealite.server")

__all__ = ["ReleasedWeights", "process_rss_bytes", "return_freed_heap"]


def process_rss_bytes() -> int:
    """This process's resident set size in bytes (``/proc/self/statm``; 0 where absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _page_size()
    except (OSError, ValueError, IndexError):
        return 0


def _page_size() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE")


def return_freed_heap() -> None:
    """Ask glibc to return freed heap pages to the system (a no-op elsewhere): freed
    allocations below its mmap threshold would otherwise stay in the process's RSS."""
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class ReleasedWeights:
    """The parameter storages of a model, released and restored as one region.

    ``cpu_backup``: keep the contents (SGLang's ``--enable-weights-cpu-backup``)."""

    def __init__(self, model: torch.nn.Module, *, cpu_backup: bool):
        self.model = model
        self.cpu_backup = cpu_backup
        self.released = False
        self._freed = FreedStorages()
        self._backups: list[torch.Tensor | None] = []

    def _storages(self) -> list[torch.UntypedStorage]:
        return distinct_storages(p.detach() for p in self.model.parameters())

    def resizable(self) -> bool:
        """Whether every parameter storage can be freed in place (not a mapped file, as the
        parameters of a model loaded from safetensors on a CPU may be)."""
        return all(st.resizable() for st in self._storages())

    def nbytes(self) -> int:
        """Bytes the parameters occupy now (tied weights once)."""
        return sum(st.nbytes() for st in self._storages())

    def release(self) -> int:
        """Free the parameter storages; returns the bytes freed (0 when a CPU model keeps
        its weights as its own backup, or when already released)."""
        if self.released:
            return 0
        storages = self._storages()
        on_cpu = all(st.device.type == "cpu" for st in storages)
        if self.cpu_backup and on_cpu:
            self.released = True
            return 0
        backups: list[torch.Tensor | None] = []
        for st in storages:
            if self.cpu_backup:
                host = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
                host.copy_(_bytes_of(st))
                backups.append(host)
            else:
                backups.append(None)
        freed = self._freed.free(storages)  # raises for a mapped file: `resizable()` says so first
        self._backups, self.released = backups, True
        if storages and storages[0].device.type == "cuda":
            torch.cuda.empty_cache()
        return_freed_heap()
        return freed

    def restore(self) -> int:
        """Give the storages their memory back (zeros, or the backup); returns the bytes."""
        if not self.released:
            return 0
        total = 0
        with torch.no_grad():
            for st, backup in zip(self._freed.regrow(), self._backups):
                view = _bytes_of(st)
                if backup is None:
                    view.zero_()
                else:
                    view.copy_(backup)
                total += st.nbytes()
        self._backups, self.released = [], False
        return total


def _bytes_of(st: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``st``."""
    return torch.tensor([], dtype=torch.uint8, device=st.device).set_(st)
