"""Freeing a tensor's memory in place and giving it back: `FreedStorages`.

Both halves of a time-shared GPU do this: the embedded server releasing its weights
(`arealite.server.memory_saver`) and the trainer parking its state in host memory
(`arealite.train_engine.offload`). Resizing a tensor's *storage* to zero bytes frees the
memory while every tensor object, view and tied weight that points at it stays the same
Python object; resizing it back gives fresh memory at the old size, whose contents the
caller then writes (zeros, a backup, a host copy).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["FreedStorages", "distinct_storages"]


def distinct_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The storages behind ``tensors`` that hold memory now, each once (several views and
    tied weights share one)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() > 0:
            seen.setdefault(st.data_ptr(), st)
    return list(seen.values())


class FreedStorages:
    """Storages whose memory was freed in place, with the sizes to give them back."""

    def __init__(self) -> None:
        self._sizes: list[tuple[torch.UntypedStorage, int]] = []

    def __bool__(self) -> bool:
        return bool(self._sizes)

    def free(self, storages: Iterable[torch.UntypedStorage]) -> int:
        """Free each storage's memory; returns the bytes freed. A storage that cannot be
        resized (a mapped file) raises before anything after it is freed."""
        freed = 0
        for st in storages:
            n = st.nbytes()
            st.resize_(0)
            self._sizes.append((st, n))
            freed += n
        return freed

    def regrow(self) -> list[torch.UntypedStorage]:
        """Give every freed storage its size back (contents undefined), in the order freed;
        returns them and forgets them."""
        out = []
        for st, n in self._sizes:
            st.resize_(n)
            out.append(st)
        self._sizes = []
        return out
