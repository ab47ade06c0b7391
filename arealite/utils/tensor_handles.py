"""Tensors handed to another process on this machine by handle, in SGLang's wire format.

SGLang's ``/update_weights_from_tensor`` takes ``serialized_named_tensors``: one entry per
tensor-parallel rank, each a list of ``(name, tensor)`` pickled with torch's multiprocessing
reductions (``ForkingPickler``) and base64-encoded for JSON (SGLang 0.5.21
``srt/utils/common.py`` ``MultiprocessingSerializer``). The pickle holds no tensor bytes,
only a handle: a CUDA IPC handle for a GPU tensor, the name of a shared-memory segment for a
CPU one. The receiver maps the same memory and copies from it.

CPU tensors are reduced with torch's ``file_system`` sharing strategy (a segment name):
the default ``file_descriptor`` strategy passes descriptors through a socket that only a
process sharing the sender's ``multiprocessing`` auth key may use, i.e. not a server
started on its own. A CPU tensor not yet in shared memory is moved there by the reduction
(a copy); the publisher's buckets live there from the start so that a push copies once.

The receiving side unpickles with a short list of allowed globals (as SGLang's
``SafeUnpickler``): a payload is data, never code.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import pickle
from collections.abc import Iterator, Sequence

import torch
import torch.multiprocessing as torch_mp
from multiprocessing.reduction import ForkingPickler

__all__ = ["TensorPayloadError", "decode_named_tensors", "encode_named_tensors", "file_system_sharing"]


class TensorPayloadError(ValueError):
    """A ``serialized_named_tensors`` entry that is not a pickled list of (name, tensor)."""


@contextlib.contextmanager
def file_system_sharing() -> Iterator[None]:
    """Reduce CPU tensors to shared-memory segment names (torch's ``file_system`` strategy)
    for the duration, then restore the process's own strategy."""
    before = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch_mp.set_sharing_strategy(before)


def encode_named_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """One ``serialized_named_tensors`` entry: ``[(name, tensor), ...]`` pickled by handle,
    base64 text. The tensors must stay alive (unchanged) until the receiver has copied them."""
    items = []
    for i, pair in enumerate(named_tensors):
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)):
            raise TypeError(f"named_tensors[{i}] must be a (str, torch.Tensor) pair, got {type(pair).__name__}")
        items.append((pair[0], pair[1].detach()))
    buf = io.BytesIO()
    with file_system_sharing():
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(items)
    return base64.b64encode(buf.getvalue()).decode("ascii")


_TORCH_TYPES = {"Tensor", "Size", "device", "dtype", "UntypedStorage"} | {
    name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}

_ALLOWED = {
    ("builtins", n) for n in ("bool", "bytes", "bytearray", "dict", "float", "int", "list", "set", "str", "tuple")
} | {("torch", n) for n in _TORCH_TYPES} | {
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("torch.nn.parameter", "Parameter"),
    ("collections", "OrderedDict"), ("copyreg", "__newobj__"),
    ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
} | {("torch.multiprocessing.reductions", n) for n in (
    "rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage", "rebuild_storage_filename",
    "rebuild_storage_fd", "rebuild_storage_empty", "rebuild_meta_tensor")} | {
    ("multiprocessing.resource_sharer", "DupFd")}


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise TensorPayloadError(f"the payload names {module}.{name}, which a tensor handle never needs")
        return super().find_class(module, name)


def decode_named_tensors(entry: object, field: str = "serialized_named_tensors[0]") -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` list of one entry (base64 text or raw pickle bytes), the tensors
    mapped from the sender's memory. Raises `TensorPayloadError` naming ``field`` and the fault."""
    if isinstance(entry, str):
        try:
            raw = base64.b64decode(entry, validate=True)
        except (binascii.Error, ValueError) as e:
            raise TensorPayloadError(f"{field} is not base64 text ({e})") from None
    elif isinstance(entry, (bytes, bytearray)):
        raw = bytes(entry)
    else:
        raise TensorPayloadError(f"{field} must be base64 text, got {type(entry).__name__}")
    try:
        value = _HandleUnpickler(io.BytesIO(raw)).load()
    except TensorPayloadError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise TensorPayloadError(f"{field} is not a pickled tensor list: {e}") from None
    except (RuntimeError, OSError) as e:  # the handle's memory is gone (sender exited) or not mappable
        raise TensorPayloadError(f"{field}: the sender's tensor memory cannot be mapped: {e}") from None
    if not isinstance(value, list) or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
            for p in value):
        raise TensorPayloadError(f"{field} must unpickle to a list of (name, tensor) pairs, "
                                 f"got {type(value).__name__}")
    return value
