"""Process-group helpers shared by the trainer processes."""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def resolve_device_type(device: str = "auto") -> str:
    """The device type a trainer process computes on, ``cuda`` or ``cpu``.

    ``auto`` follows the default process group if one exists (NCCL: cuda,
    gloo: cpu), else takes CUDA when available. ``cpu`` keeps a process on the
    CPU (and gloo) even on a GPU machine.
    """
    if device == "auto":
        if dist.is_initialized():
            return "cuda" if dist.get_backend() == "nccl" else "cpu"
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not one of auto, cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available; use 'cpu' or 'auto'")
    return device


def default_backend(device_type: str | None = None) -> str:
    """``nccl`` for ``cuda``, ``gloo`` for ``cpu`` (None: the device ``resolve_device_type`` picks)."""
    return "nccl" if (device_type or resolve_device_type()) == "cuda" else "gloo"


def barrier() -> None:
    """Wait for every rank of the default group (nothing to wait for without one, or alone)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bound_store(addr: str, port: int, timeout_s: float, *, multi_tenant: bool = False) -> dist.TCPStore:
    """A TCPStore server listening on ``addr`` alone, not on every interface as a TCPStore
    given only a port does: the socket is bound here and handed over (``master_listen_fd``;
    the store owns it from then on). It does not wait for its peers to connect.

    With ``multi_tenant``, a later multi-tenant TCPStore server of this process on the same
    port is this one (torch keeps one server per port), which is how torchrun's rendezvous
    store is bound (`arealite.launcher.torchrun`).
    """
    family, kind, proto, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(addr, port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False,
                         multi_tenant=multi_tenant, master_listen_fd=sock.detach())


def _env_store(rank: int, world: int, timeout_s: float) -> dist.Store:
    """The default group's store at ``MASTER_ADDR:MASTER_PORT``: rank 0 serves it on that
    address alone (`bound_store`), the others connect to it."""
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    if rank == 0:
        return bound_store(addr, port, timeout_s)
    return dist.TCPStore(addr, port, world, False, timedelta(seconds=timeout_s))


def init_default_group(backend: str | None = None, timeout_s: float = 1800.0) -> bool:
    """Join the default process group; return True if this call created it.

    Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set) the group
    spans the launched processes; launched with that environment by another launcher
    (Ray), rank 0 serves the group's store on ``MASTER_ADDR`` alone, not on every
    interface. Without that environment a world of one is created on a free local port,
    so the same training code runs in a plain ``python`` process. An existing default
    group is reused (returns False).
    """
    if dist.is_initialized():
        return False
    backend = backend or default_backend()
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's (bound) store
            dist.init_process_group(backend=backend, timeout=timeout)
        else:  # launched without torchrun (Ray): rank 0's store, bound to MASTER_ADDR alone
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend=backend, timeout=timeout, rank=rank, world_size=world,
                                    store=_env_store(rank, world, timeout_s))
    else:
        port = free_port()
        logger.info("no torchrun environment: creating a world-size-1 %s group on port %d", backend, port)
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=1,
            timeout=timeout,
        )
    return True


def all_reduce_scalar(value: float, op: str = "sum", device: torch.device | str = "cpu") -> float:
    """All-reduce one Python number over the default group (``sum`` or ``max``)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return float(t.item())
