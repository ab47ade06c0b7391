"""Weight transfer by tensor handles, for servers on the trainer's machine (``weight_sync.method: tensor``).

SGLang's ``/update_weights_from_tensor`` (docs/sglang.md, "update_weights_from_tensor"):
the trainer pickles each bucket's tensors with torch's multiprocessing reductions, which
carry no bytes, only where the memory is (`arealite.utils.tensor_handles`); every server
maps that memory and copies it into its weights. No disk, no process group: the push of
the colocated placement, where trainer and servers share the machine (and the GPU).

    transfer: (servers paused by the publisher)
              begin_weight_update                       (SGLang >= 0.5.21; skipped elsewhere)
              per bucket: CPU tensors are copied into one shared-memory staging buffer,
                          reused by every bucket; CUDA tensors go as they are (CUDA IPC)
                          when every server is on a GPU
                          /update_weights_from_tensor {serialized_named_tensors, flush_cache,
                                                       weight_version with the last bucket only}
              end_weight_update

A CPU push thus copies twice (trainer -> staging buffer -> server), a GPU push once. A
server that is gone is dropped (`call_dropping_dead`); any other failure raises
`WeightSyncError`, and the session is closed either way.
"""

from __future__ import annotations

import torch

from arealite.api.contracts import Runner, TensorUpdateAdmin, WeightSource, require
from arealite.utils.net import is_local_host, split_addr
from arealite.utils.tensor_handles import file_system_sharing
from arealite.weight_sync.base import (
    Timer, WeightSyncError, bucket_bytes_of, call_dropping_dead, cast_for_servers, end_session, logger, with_last)

#: Slot alignment in the staging buffer (bytes): every dtype view stays legal.
ALIGN = 64

_ENGINES = ("arealite-embedded", "sglang")


class TensorTransfer:
    """Moves weights to servers on this machine as tensor handles, bucket by bucket.

    `server_dtype` is the servers' weight dtype (None: ask the embedded servers at `init`).
    `run(coro)` runs `admin` coroutines on the client's loop.
    """

    def __init__(self, config, admin: TensorUpdateAdmin, run: Runner, *, server_dtype: torch.dtype | None = None):
        require(admin, TensorUpdateAdmin, "the servers' admin of weight_sync.method=tensor")
        self.config = config
        self.admin = admin
        self.run = run
        self.server_dtype = server_dtype
        self.cuda_ipc = False  # every server on a GPU: CUDA tensors go as they are
        self._staging: torch.Tensor | None = None  # uint8, in shared memory, grown as needed

    @property
    def bucket_bytes(self) -> int:
        return bucket_bytes_of(self.config)

    def init(self, master_addr: str | None = None) -> None:
        """Check that every server is on this machine and speaks the route; learn their dtype."""
        dtypes, devices = set(), set()
        for addr in self.admin.servers:
            host, _ = split_addr(addr)
            if not is_local_host(host):
                raise WeightSyncError(f"weight_sync.method=tensor needs every server on the trainer's machine "
                                      f"(handles to its memory); {addr} is not: use weight_sync.method="
                                      "distributed or disk", server=addr)
            info = self.admin.server_info(addr)
            engine = str(info.get("engine") or ("sglang" if info.get("version") else "an unknown engine"))
            if engine not in _ENGINES:
                raise WeightSyncError(f"weight_sync.method=tensor needs the embedded server or SGLang; {addr} runs "
                                      f"{engine}: use weight_sync.method=distributed or disk", server=addr)
            if info.get("dtype"):
                dtypes.add(str(info["dtype"]))
            devices.add(str(info.get("device") or ("cuda" if engine == "sglang" else "cpu")).split(":")[0])
        if self.server_dtype is None and len(dtypes) == 1:
            self.server_dtype = getattr(torch, dtypes.pop())
        elif self.server_dtype is None and len(dtypes) > 1:
            raise WeightSyncError(f"the servers hold weights in different dtypes {sorted(dtypes)}; "
                                  "set server.dtype so that they agree")
        self.cuda_ipc = devices == {"cuda"}

    def stage(self, source: WeightSource, version: int) -> dict[str, float]:
        """Nothing to do before the pause: each bucket is handed over while the servers wait."""
        return {}

    def transfer(self, source: WeightSource, version: int) -> dict[str, float]:
        """Push every bucket to every server (paused), inside a weight-update session."""
        timer = Timer()
        call_dropping_dead(self.run, self.admin, self.admin.begin_weight_update, version, "begin_weight_update")
        try:
            n_buckets, n_tensors, n_bytes = self._push_all(source, version)
        finally:
            end_session(self.run, self.admin, version)
        timer.lap("push_s")
        logger.info("version %d handed over by tensor handles: %d tensors, %.1f MB in %d bucket(s)",
                    version, n_tensors, n_bytes / 2**20, n_buckets)
        return dict(timer.timings, bytes=float(n_bytes), n_buckets=float(n_buckets), n_tensors=float(n_tensors))

    def _push_all(self, source: WeightSource, version: int) -> tuple[int, int, int]:
        n_buckets = n_tensors = n_bytes = 0
        seen: set[str] = set()
        for bucket, last in with_last(source.named_weight_buckets(self.bucket_bytes)):
            named = self._handover(bucket, seen)
            n_buckets += 1
            n_tensors += len(named)
            n_bytes += sum(t.numel() * t.element_size() for _, t in named)
            call_dropping_dead(self.run, self.admin, lambda: self.admin.update_weights_from_tensor(
                named, version if last else None, flush_cache=None if last else False, timeout=self.config.timeout_s),
                version, "update_weights_from_tensor")
        return n_buckets, n_tensors, n_bytes

    def _handover(self, bucket: list[tuple[str, torch.Tensor]], seen: set[str]) -> list[tuple[str, torch.Tensor]]:
        """The bucket's tensors as the servers will map them: in the servers' dtype, CUDA ones
        as they are (CUDA IPC), the others as views of the shared staging buffer."""
        out, host = [], []
        for name, t in bucket:
            if name in seen:
                raise WeightSyncError(f"the train engine yields tensor {name!r} twice", tensor=name)
            seen.add(name)
            t = cast_for_servers(name, t.detach(), self.server_dtype)
            if self.cuda_ipc and t.is_cuda:
                out.append((name, t.contiguous()))
            else:
                host.append((name, t))
        if host:
            if self._staging is None or self._staging.numel() < packed_bytes(host):
                self._staging = None  # grown: the old segment goes first
                self._staging = shared_buffer(packed_bytes(host))
            out += pack_into(self._staging, host)
        return out

    def close(self) -> None:
        """Free the staging buffer (safe to call twice)."""
        self._staging = None


def packed_bytes(named: list[tuple[str, torch.Tensor]]) -> int:
    """Bytes `pack_into` needs for ``named`` (each tensor at an `ALIGN`-byte boundary)."""
    return sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for _, t in named)


def shared_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU buffer in shared memory under a segment name (``file_system``), as the
    handles name it, so that pickling its views never moves it again."""
    with file_system_sharing():
        return torch.empty(max(nbytes, ALIGN), dtype=torch.uint8).share_memory_()


def pack_into(buf: torch.Tensor, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Copy each tensor into its aligned slot of ``buf``; returns the slots, named."""
    out, pos = [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        slot = buf[pos:pos + n].view(t.dtype).view(t.shape)
        slot.copy_(t)
        out.append((name, slot))
        pos += -(-n // ALIGN) * ALIGN
    return out
