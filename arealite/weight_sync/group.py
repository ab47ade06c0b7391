"""The trainer's side of the weight-update process group (rank 0 of it).

The group is built directly as a backend object (``ProcessGroupGloo`` /
``ProcessGroupNCCL``) over a ``PrefixStore``, never through
``init_process_group``: it must not touch (or need) the trainer's default
group, and a plain ``init_process_group`` would not rendezvous with SGLang.

Two store layouts exist, because the two server kinds name their keys
differently:

- ``embedded`` (arealite's server): ``PrefixStore(group_name, store)``;
- ``sglang``: SGLang builds its group with torch's ``_new_process_group_helper``,
  which nests ``PrefixStore(f"{group_name}/")`` and ``PrefixStore("cuda/")`` (one per
  device of the backend) inside ``PrefixStore(group_name, store)``. SGLang runs
  on CUDA, so only NCCL is supported with it.
"""

from __future__ import annotations

import datetime
from typing import Literal

import torch
import torch.distributed as dist

from arealite.utils.dist import bound_store

Layout = Literal["embedded", "sglang"]


class UpdateGroup:
    """Rank 0 of a weight-update group: hosts the TCP store and broadcasts."""

    def __init__(self, store: dist.TCPStore, pg, backend: str, device: torch.device,
                 group_name: str, world_size: int):
        self.store, self.pg, self.backend = store, pg, backend
        self.device, self.group_name, self.world_size = device, group_name, world_size

    @staticmethod
    def host_store(master_addr: str, port: int, timeout_s: float) -> dist.TCPStore:
        """Start the TCP store on `port`, listening on `master_addr` alone (the address the
        servers are told to reach); it does not wait for the peers to connect."""
        return bound_store(master_addr, port, timeout_s)

    @classmethod
    def join(cls, store: dist.TCPStore, *, group_name: str, world_size: int, backend: str,
             layout: Layout, timeout_s: float) -> "UpdateGroup":
        """Join as rank 0; blocks until every server has joined (or the timeout)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        prefix = dist.PrefixStore(group_name, store)
        if layout == "sglang":
            if backend != "nccl":
                raise ValueError(
                    f"weight_sync.backend={backend!r} with SGLang servers: SGLang runs on CUDA and "
                    "its group only rendezvouses with NCCL; set weight_sync.backend=nccl (or auto)")
            prefix = dist.PrefixStore("cuda/", dist.PrefixStore(f"{group_name}/", prefix))
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(prefix, 0, world_size, timeout)
            device = torch.device("cpu")
        elif backend == "nccl":
            pg = dist.ProcessGroupNCCL(prefix, 0, world_size, timeout)
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            raise ValueError(f"weight_sync.backend={backend!r}: expected gloo or nccl")
        return cls(store, pg, backend, device, group_name, world_size)

    def broadcast(self, tensors: list[torch.Tensor]):
        """Start broadcasting `tensors` from rank 0, in order; returns the pending works."""
        works = []
        for t in tensors:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            opts.rootTensor = 0
            # gloo has no float8 type: the bytes travel as uint8 (the server views them back).
            works.append(self.pg.broadcast([t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t], opts))
        return works

    def close(self) -> None:
        """Drop the group and the store (peers see their connections close)."""
        shutdown = getattr(self.pg, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except RuntimeError:  # a peer already went away
                pass
        self.pg = None
        self.store = None
