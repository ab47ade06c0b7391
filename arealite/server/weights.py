"""Weight updates of the embedded server: from an HF directory, a shared-memory file or a process group.

Every update is all-or-nothing: the new tensors are checked (names, shapes,
dtypes) and fully received before any of them is copied into the model, so a
bad update leaves the old weights serving. Only a disk checkpoint may differ in
dtype, and only float from float: it is cast to the model's dtype, as SGLang does.

Process-group protocol (as SGLang's, see docs/internals.md): trainer rank 0
hosts a ``TCPStore``; every server joins a group built over
``PrefixStore(group_name, store)`` with ``rank = rank_offset``. The group object
is built directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), so it never
touches a default process group. Per update, rank 0 broadcasts the tensors of
``names`` in order, either one broadcast per tensor or, with
``load_format: "flattened_bucket"`` (or ``flattened_bucket: true``), a single 1-D broadcast of all of them concatenated
(one dtype). A server that finds the metadata inconsistent with its model still
receives every broadcast into its receive buffers (so the sender is never left
hanging), discards them, and answers ``success: false`` naming the tensor.

Shared-memory protocol (trainer and server on one host): the trainer keeps one
file (under ``/dev/shm``) holding every tensor at a given byte offset in the
server's dtype and posts ``/update_weights_from_shm {path, names, dtypes,
shapes, offsets}``. The server maps the file once (`ShmWeightFile`) and keeps
the mapping while the file stays the same, so later updates are a plain copy
from already-mapped pages.
"""

from __future__ import annotations

import datetime
import logging
import mmap
import os
import threading
import warnings
from pathlib import Path

import torch

from arealite.utils.checkpoint_names import checkpoint_views

from .files import UnsafeFile, checkpoint_files, load_safetensors, open_regular
from .fp8_linear import arrives_quantised, store
from .limits import short

logger = logging.getLogger("arealite.server")


class WeightUpdateError(ValueError):
    """An update that cannot be applied; the old weights stay."""


def parse_dtype(name: object, where: str = "dtype") -> torch.dtype:
    """``"bfloat16"`` / ``"torch.bfloat16"`` -> ``torch.bfloat16``."""
    if not isinstance(name, str):
        raise WeightUpdateError(f"{where}: expected a dtype name such as 'bfloat16', got {short(name)}")
    bare = name.removeprefix("torch.")
    dt = getattr(torch, bare, None)
    if not isinstance(dt, torch.dtype):
        raise WeightUpdateError(f"{where}: {short(name)} is not a torch dtype (e.g. 'float32', 'bfloat16')")
    return dt


def parse_shape(shape: object, where: str = "shape") -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise WeightUpdateError(f"{where}: expected a list of non-negative ints, got {short(shape)}")
    return tuple(shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors by the names and shapes of its HF checkpoint (tied weights appear under
    both names; a mixture-of-experts layer's fused experts as views, one per expert and projection,
    so that an update by checkpoint name writes into them: `arealite.utils.checkpoint_names`)."""
    return checkpoint_views(model, dict(model.state_dict(keep_vars=False)))


def _required_names(state: dict[str, torch.Tensor]) -> list[str]:
    """One name per distinct storage: what a full checkpoint must contain.

    Tied weights (``lm_head.weight`` sharing ``model.embed_tokens.weight``)
    count once; a checkpoint may give either name.
    """
    seen: dict[int, str] = {}
    for name, t in state.items():
        seen.setdefault(t.data_ptr(), name)
    return list(seen.values())


def check_metadata(
    state: dict[str, torch.Tensor], names: list[str], dtypes: list[torch.dtype], shapes: list[tuple[int, ...]]
) -> str | None:
    """Why (names, dtypes, shapes) cannot update this model, or None if they can."""
    seen = set()
    for name, dt, shape in zip(names, dtypes, shapes):
        if name in seen:
            return f"tensor {name!r} is given twice"
        seen.add(name)
        if name not in state:
            return f"tensor {name!r} is not a weight of this model"
        t = state[name]
        if tuple(t.shape) != shape:
            return f"tensor {name!r}: shape {list(shape)} does not match the model's {list(t.shape)}"
        if t.dtype != dt and not arrives_quantised(t, dt):
            return f"tensor {name!r}: dtype {dt} does not match the model's {t.dtype}"
    return None


def read_hf_dir(model_path: str) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors directory (single file or sharded).

    Files are opened by `arealite.server.files` (regular files only, an index naming
    files inside the directory only); any bad file is an error naming it.
    """
    root = Path(model_path)
    if not root.is_dir():
        raise WeightUpdateError(f"model_path {short(model_path, 300)} is not a directory")
    files = checkpoint_files(root)
    if not files:
        raise WeightUpdateError(f"model_path {short(model_path, 300)} holds no *.safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_safetensors(f))
    return tensors


def check_full_checkpoint(state: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> str | None:
    """Why ``tensors`` is not a complete, matching checkpoint of the model, or None.

    As in SGLang, a floating-point tensor may have another floating-point dtype
    than the model's (the trainer writes its fp32 master weights; a bf16 server
    casts them on load); any other dtype difference is refused.
    """
    for name, t in tensors.items():
        if name not in state:
            return f"tensor {name!r} of the checkpoint is not a weight of this model"
        want = state[name]
        if tuple(t.shape) != tuple(want.shape):
            return f"tensor {name!r}: shape {list(t.shape)} does not match the model's {list(want.shape)}"
        if t.dtype != want.dtype and not (t.dtype.is_floating_point and want.dtype.is_floating_point):
            return (f"tensor {name!r}: dtype {t.dtype} does not match the model's {want.dtype} "
                    "(only floating-point tensors are cast on load)")
    by_ptr: dict[int, list[str]] = {}
    for name, t in state.items():
        by_ptr.setdefault(t.data_ptr(), []).append(name)
    for aliases in by_ptr.values():
        if any(_scale_made_on_arrival(a, state, tensors) for a in aliases):
            continue
        if not any(a in tensors for a in aliases):
            return f"the checkpoint lacks tensor {aliases[0]!r} (a partial update would mix old and new weights)"
    return None


def _scale_made_on_arrival(name: str, state: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> bool:
    """Whether `name` is the scale of an FP8 weight that `tensors` gives in float: the
    server quantises that weight on arrival and writes this scale itself (`store`)."""
    weight = name.removesuffix("_scale_inv")
    return weight != name and weight in tensors and arrives_quantised(state[weight], tensors[weight].dtype)


@torch.no_grad()
def copy_into_model(state: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """Copy checked tensors into the model's own storage (casting to its dtype; quantising
    a floating tensor sent to an FP8 weight, `arealite.server.fp8_linear.store`)."""
    for name, t in tensors.items():
        store(state, name, t)


class ShmWeightFile:
    """A read-only shared mapping of the trainer's weight file, reused across updates.

    `key` identifies the file (path, device, inode, size): a file re-created
    under the same path is a different file and must be mapped anew.
    """

    def __init__(self, path: str):
        try:  # a FIFO or device is refused before it is opened, and the open never blocks
            fd = open_regular(path, "path")
        except UnsafeFile as e:
            raise WeightUpdateError(str(e)) from None
        try:
            st = os.fstat(fd)
            if st.st_size == 0:
                raise WeightUpdateError(f"path {path!r} is empty")
            # MAP_POPULATE fills the page tables now, not one fault per page during the copy.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(fd, st.st_size, flags=flags, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.path = path
        self.size = st.st_size
        self.key = file_key(path, st)
        with warnings.catch_warnings():  # read-only buffer: the tensor is only ever read
            warnings.simplefilter("ignore")
            self.buf = torch.frombuffer(self._mm, dtype=torch.uint8)

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A view of the bytes at `offset` as a tensor (checked by `check_shm_layout`)."""
        n = _numel(shape) * _itemsize(dtype)
        return self.buf[offset:offset + n].view(dtype).view(shape)

    def close(self) -> None:
        self.buf = None
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere: the GC unmaps it later
            pass


def file_key(path: str, st: os.stat_result) -> tuple:
    return (path, st.st_dev, st.st_ino, st.st_size)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def check_shm_layout(state: dict[str, torch.Tensor], names: list[str], dtypes: list[torch.dtype],
                     shapes: list[tuple[int, ...]], offsets: list[int], size: int) -> str | None:
    """Why the tensors at `offsets` of a `size`-byte file cannot update this model, or None.

    Names, shapes and dtypes must match the model (no cast: the trainer writes the
    server's dtype), every tensor must lie inside the file at an offset aligned to its
    element size, and every weight must be given (tied weights once).
    """
    problem = check_metadata(state, names, dtypes, shapes)
    if problem:
        return problem
    for i, (name, dt, shape, off) in enumerate(zip(names, dtypes, shapes, offsets)):
        n = _numel(shape) * _itemsize(dt)
        if off % _itemsize(dt):
            return (f"tensor {name!r}: offsets[{i}] = {off} is not a multiple of its element size "
                    f"{_itemsize(dt)} ({dt})")
        if off + n > size:
            return (f"tensor {name!r}: offsets[{i}] = {off} + {n} bytes runs past the end of the "
                    f"file ({size} bytes)")
    given = set(names)
    by_ptr: dict[int, list[str]] = {}
    for name, t in state.items():
        by_ptr.setdefault(t.data_ptr(), []).append(name)
    for aliases in by_ptr.values():
        if not any(a in given for a in aliases):
            return (f"names lack tensor {aliases[0]!r} (an update must give every weight; a "
                    "partial one would mix old and new weights)")
    return None


def _aligned(nbytes: int) -> int:
    """`nbytes` rounded up to 64, so that every tensor of a receive buffer starts aligned."""
    return -(-nbytes // 64) * 64


class ReceiveBuffers:
    """The memory a weight-update group receives buckets into, kept across buckets and pushes.

    A fresh buffer per bucket paid its page faults on every push (~6,000 a push of the 189 MB
    model; docs/scale.md, "Weight push against a memory copy"). Up to `SPARE` buffers are kept:
    one being copied into the model while the next bucket arrives in another. A buffer is
    handed back only after its bucket loaded (nothing reads it any more, and its size is that of
    real weights: a refused bucket's buffer, of unchecked shapes, is dropped).
    """

    #: Buffers kept between buckets (the largest ones).
    SPARE = 2

    def __init__(self, device: torch.device):
        self.device = device
        self._spare: list[torch.Tensor] = []  # uint8, sorted by size
        self._lock = threading.Lock()  # taken on the event loop, handed back there or by a worker

    def take(self, dtypes: list[torch.dtype], shapes: list[tuple[int, ...]]) -> torch.Tensor:
        """A buffer for one bucket of these tensors: the smallest spare one large enough, else
        a new one."""
        need = sum(_aligned(_numel(s) * dt.itemsize) for dt, s in zip(dtypes, shapes))
        with self._lock:
            fits = [i for i, b in enumerate(self._spare) if b.numel() >= need]
            if fits:
                return self._spare.pop(fits[0])
        return torch.empty(need, dtype=torch.uint8, device=self.device)

    def give_back(self, buf: torch.Tensor) -> None:
        """Keep `buf` for a later bucket (only the `SPARE` largest are kept)."""
        with self._lock:
            self._spare = sorted(self._spare + [buf], key=torch.Tensor.numel)[-self.SPARE:]


class WeightUpdateGroup:
    """This server's membership in a trainer's weight-broadcast process group."""

    def __init__(self, *, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                 backend: str, timeout_s: float, device: torch.device):
        self.group_name = group_name
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device if backend == "nccl" else torch.device("cpu")
        timeout = datetime.timedelta(seconds=timeout_s)
        # Blocks until rank 0 has created the store; the caller runs this in a thread.
        store = torch.distributed.TCPStore(
            master_address, master_port, world_size, is_master=False, timeout=timeout
        )
        self._store = store  # the prefix store does not keep its parent alive in all releases
        prefix = torch.distributed.PrefixStore(group_name, store)
        if backend == "gloo":
            self.pg = torch.distributed.ProcessGroupGloo(prefix, rank, world_size, timeout)
        elif backend == "nccl":
            self.pg = torch.distributed.ProcessGroupNCCL(prefix, rank, world_size, timeout)
        else:  # checked by the route; kept for direct callers
            raise WeightUpdateError(f"backend {backend!r} is not supported (gloo or nccl)")
        self.buffers = ReceiveBuffers(self.device)

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        # gloo has no float8 type: FP8 weights arrive as their bytes (a uint8 view of `t`).
        self.pg.broadcast([t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t], opts).wait()

    def receive(self, dtypes: list[torch.dtype], shapes: list[tuple[int, ...]], flattened: bool,
                buf: torch.Tensor) -> list[torch.Tensor]:
        """Receive the tensors rank 0 broadcasts, in order (per tensor, or one flat bucket),
        into `buf` (from ``self.buffers.take``); the tensors returned are views of it."""
        if flattened:
            n = sum(_numel(s) for s in shapes)
            flat = buf[:n * dtypes[0].itemsize].view(dtypes[0])
            self._broadcast(flat)
            out, offset = [], 0
            for s in shapes:
                n = _numel(s)
                out.append(flat[offset:offset + n].view(s))
                offset += n
            return out
        out, offset = [], 0
        for dt, s in zip(dtypes, shapes):
            nbytes = _numel(s) * dt.itemsize
            t = buf[offset:offset + nbytes].view(dt).view(s)
            offset += _aligned(nbytes)
            self._broadcast(t)
            out.append(t)
        return out

    def destroy(self) -> None:
        # Dropping the last reference closes the connections; gloo has no
        # explicit shutdown in every release, so be tolerant here.
        shutdown = getattr(self.pg, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except RuntimeError as e:  # already torn down by the peer
                logger.debug("process group shutdown: %s", e)
        self.pg = None
        self._store = None
