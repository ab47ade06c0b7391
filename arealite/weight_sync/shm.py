"""Weight transfer through one shared-memory file, for embedded servers on the trainer's host.

Used on trainer rank 0 (the publisher keeps the other ranks reading the source in step),
which keeps files under `weight_sync.shm_dir` (``/dev/shm``: RAM) that hold every
tensor at a fixed, 64-byte aligned offset in the servers' dtype. A file is mapped once
and reused by every update, so after the first one its pages are already there
(first-touch faults on tmpfs cost more than the copy itself).

With `weight_sync.shm_alias` (the default) the servers serve straight out of the file
(their parameters point into it: no copy on their side), so there are two files and
each update writes the one no server serves from, then has the servers switch to it.
Without it there is one file, which the servers copy out of at each update (so
rewriting it while they generate is safe). Per update:

    stage:    copy each tensor of engine.named_weight_buckets into its slot of the file
              (servers still generating)
    transfer: (servers paused by the publisher) post
              /update_weights_from_shm {path, names, dtypes, shapes, offsets, weight_version}
              (the server checks everything, then copies the slots into its parameters)

That is one memory copy in all with aliasing (trainer -> file), two without (-> server),
against the disk method's serialize + read + copy. When the tensors' names, dtypes or shapes change
between updates, the file is re-created with the new layout. `close` deletes it (a
finalizer does too when the trainer exits without calling it).

Server faults are handled as by the other transfers (`call_dropping_dead`): a server
that is gone is dropped; any other failure raises `WeightSyncError`.
"""

from __future__ import annotations

import mmap
import os
import uuid
import warnings
import weakref
from pathlib import Path

import torch

from arealite.api.contracts import Runner, ShmUpdateAdmin, WeightSource, require
from arealite.utils.net import is_local_host, split_addr
from arealite.weight_sync.base import (
    Timer,
    cast_for_servers,
    WeightSyncError,
    bucket_bytes_of,
    call_dropping_dead,
    logger,
)

#: Slot alignment in bytes: keeps every dtype view legal and copies cache-line aligned.
ALIGN = 64

_EMBEDDED = "arealite-embedded"

Entry = tuple[str, torch.dtype, tuple[int, ...]]


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize


class ShmLayout:
    """Where each tensor lives in the file: byte offsets of (name, dtype, shape) entries."""

    def __init__(self, entries: list[Entry]):
        self.entries = list(entries)
        self.offsets: list[int] = []
        pos = 0
        for _, dt, shape in self.entries:
            self.offsets.append(pos)
            pos += -(-_nbytes(dt, shape) // ALIGN) * ALIGN
        self.size = max(pos, ALIGN)

    def __len__(self) -> int:
        return len(self.entries)


class ShmBuffer:
    """A file of `size` bytes under `directory`, mapped read-write into this process."""

    def __init__(self, directory: Path, size: int):
        self.path = directory / f"arealite-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self.size = size
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        # A trainer that ends without close() must not leave the file filling RAM.
        self._finalizer = weakref.finalize(self, _unlink, str(self.path))

    def slot(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self.buf[offset:offset + _nbytes(dtype, shape)].view(dtype).view(shape)

    def close(self) -> None:
        self.buf = None
        try:
            self._mm.close()
        except BufferError:  # a slot view is still referenced; the GC unmaps it later
            pass
        self._finalizer()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmTransfer:
    """Moves weights through one persistent shared-memory file (embedded servers on this host).

    `server_dtype` is the servers' weight dtype (None: ask the servers at `init`).
    `run(coro)` runs `admin` coroutines on the client's loop.
    """

    def __init__(self, config, admin: ShmUpdateAdmin, run: Runner, *, shm_dir: str | Path | None = None,
                 server_dtype: torch.dtype | None = None):
        require(admin, ShmUpdateAdmin, "the servers' admin of weight_sync.method=shm")
        self.config = config
        self.admin = admin
        self.run = run
        self.shm_dir = Path(shm_dir if shm_dir is not None else getattr(config, "shm_dir", "/dev/shm"))
        self.server_dtype = server_dtype
        self.alias = bool(getattr(config, "shm_alias", False))
        # One file (copy mode) or two (alias mode): each a layout and its mapped buffer.
        self._slots: list[list] = [[None, None] for _ in range(2 if self.alias else 1)]
        self._serving: int | None = None  # the slot the servers hold (alias: serve from)
        self._staged: tuple[int, bool] | None = None  # (bytes, whether the file was re-created)

    @property
    def bucket_bytes(self) -> int:
        return bucket_bytes_of(self.config)

    @property
    def path(self) -> Path | None:
        """The file the servers last loaded (None before the first update or after `close`)."""
        if self._serving is None or self._slots[self._serving][1] is None:
            return None
        return self._slots[self._serving][1].path

    def _target(self) -> int:
        """The slot to write: the one no server serves from."""
        return 0 if len(self._slots) == 1 or self._serving is None else 1 - self._serving

    def init(self, master_addr: str | None = None) -> None:
        """Check that every server is an embedded one on this host; learn their dtype."""
        if not self.shm_dir.is_dir() or not os.access(self.shm_dir, os.W_OK):
            raise WeightSyncError(f"weight_sync.shm_dir={str(self.shm_dir)!r} is not a writable directory; "
                                  "point it at a tmpfs directory such as /dev/shm")
        dtypes = set()
        for addr in self.admin.servers:
            host, _ = split_addr(addr)
            if not is_local_host(host):
                raise WeightSyncError(f"weight_sync.method=shm needs every server on this host; {addr} is "
                                      "not: use weight_sync.method=distributed or disk", server=addr)
            info = self.admin.server_info(addr)
            if info.get("engine") != _EMBEDDED:
                raise WeightSyncError(f"weight_sync.method=shm needs the embedded server; {addr} runs "
                                      f"{info.get('engine') or 'an unknown engine'}: use "
                                      "weight_sync.method=distributed or disk", server=addr)
            if info.get("dtype"):
                dtypes.add(str(info["dtype"]))
            self._copy_for_device(addr, str(info.get("device") or "cpu"))
        if self.server_dtype is None and dtypes:
            if len(dtypes) > 1:
                raise WeightSyncError(f"the servers hold weights in different dtypes {sorted(dtypes)}; "
                                      "set server.dtype so that they agree")
            self.server_dtype = getattr(torch, dtypes.pop())

    def _copy_for_device(self, addr: str, device: str) -> None:
        """A server on a GPU cannot serve out of a host file (it refuses ``alias``): it copies
        the weights into device memory anyway, so every server loads by copy (one file)."""
        if self.alias and not device.startswith("cpu"):
            logger.warning("weight_sync.shm_alias: server %s runs on %s, which copies the weights into its "
                           "own memory: every server loads them by copy", addr, device)
            self.alias = False
            self._slots = [[None, None]]

    def _prepare(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return cast_for_servers(name, t.detach(), self.server_dtype)

    def _fill(self, engine: WeightSource, bucket_bytes: int, slot: list) -> tuple[int, bool]:
        """Copy every tensor into the slot's file; returns (bytes, whether the file was re-created)."""
        old, buf = slot
        entries: list[Entry] = []
        seen: set[str] = set()
        pending: list[tuple[int, torch.Tensor]] = []  # tensors that do not fit the old layout
        n_bytes = 0
        for bucket in engine.named_weight_buckets(bucket_bytes):
            for name, t in bucket:
                if name in seen:
                    raise WeightSyncError(f"the train engine yields tensor {name!r} twice", tensor=name)
                seen.add(name)
                t = self._prepare(name, t)
                i = len(entries)
                entry = (name, t.dtype, tuple(t.shape))
                entries.append(entry)
                n_bytes += t.numel() * t.element_size()
                if buf is not None and not pending and i < len(old) and old.entries[i] == entry:
                    buf.slot(old.offsets[i], *entry[1:]).copy_(t)
                else:
                    # Keep it until the new layout is known (only when the layout changed).
                    pending.append((i, t.to("cpu")))
        if buf is not None and not pending and len(entries) == len(old):
            return n_bytes, False
        # New layout: carry over what already went into the old file, then place the rest.
        layout = ShmLayout(entries)
        new = ShmBuffer(self.shm_dir, layout.size)
        try:
            first_pending = pending[0][0] if pending else len(entries)
            for i in range(first_pending):
                new.slot(layout.offsets[i], *entries[i][1:]).copy_(buf.slot(old.offsets[i], *entries[i][1:]))
            for i, t in pending:
                new.slot(layout.offsets[i], *entries[i][1:]).copy_(t)
        except BaseException:
            new.close()
            raise
        if buf is not None:
            buf.close()
        slot[:] = [layout, new]
        logger.info("weight sync: shared-memory file %s holds %d tensors (%.1f MB)",
                    new.path, len(entries), layout.size / 2**20)
        return n_bytes, True

    def stage(self, source: WeightSource, version: int) -> dict[str, float]:
        """Copy every tensor into the file (the servers still generate)."""
        timer = Timer()
        self._staged = None
        self._staged = self._fill(source, self.bucket_bytes, self._slots[self._target()])
        timer.lap("write_s")
        return timer.timings

    def transfer(self, source: WeightSource, version: int) -> dict[str, float]:
        """Load the file on every server (paused)."""
        if self._staged is None:
            raise RuntimeError("ShmTransfer.transfer without stage(): the publisher calls stage first")
        (n_bytes, recreated), self._staged = self._staged, None
        timer = Timer()
        target = self._target()
        layout, buffer = self._slots[target]
        path = str(buffer.path)
        call_dropping_dead(self.run, self.admin, lambda: self.admin.update_weights_from_shm(
            path, [e[0] for e in layout.entries], [e[1] for e in layout.entries],
            [e[2] for e in layout.entries], layout.offsets, version, timeout=self.config.timeout_s,
            alias=self.alias),
            version, "update_weights_from_shm")
        self._serving = target  # only now: a failed update leaves the servers on the other file
        timer.lap("load_s")
        out = dict(timer.timings, bytes=float(n_bytes), n_tensors=float(len(layout)), recreated=float(recreated))
        logger.info("version %d loaded through shared memory: %d tensors, %.1f MB",
                    version, len(layout), n_bytes / 2**20)
        return out

    def close(self) -> None:
        """Delete the shared-memory files (safe to call twice)."""
        for slot in self._slots:
            if slot[1] is not None:
                slot[1].close()
            slot[:] = [None, None]
        self._serving = None
