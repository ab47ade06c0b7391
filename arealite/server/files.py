"""Opening the files a weight route names, trusting none of them.

A path in a request may name a FIFO (``open`` would block forever), a device
(``/dev/zero`` reads forever), a directory, or a symlink to any of these; an index
may point at files outside its checkpoint; a shard may be truncated or not
safetensors at all. Here every file is checked to be a regular file before it is
opened (``os.stat``, which follows symlinks, so a link to a regular file is fine),
opened non-blocking and checked again on the open descriptor (the path may have
been swapped in between), and every library error becomes an `UnsafeFile` that
names the file. Callers hold no lock while these run.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path, PurePosixPath
import torch

from arealite.utils.json_types import JsonValue

from .limits import short

#: Largest JSON side file read (index, adapter config): real ones are kilobytes.
MAX_JSON_BYTES = 64 * 1024 * 1024
INDEX_NAME = "model.safetensors.index.json"


class UnsafeFile(ValueError):
    """A file a request names that the server will not (or cannot) read; the message names it."""


def check_regular(path: str | os.PathLike, what: str, max_bytes: int | None = None) -> os.stat_result:
    """``os.stat(path)`` when it is a regular file (of at most ``max_bytes``); `UnsafeFile` otherwise."""
    try:
        st = os.stat(path)
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise UnsafeFile(f"{what} {short(str(path), 300)} cannot be opened: {getattr(e, 'strerror', None) or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(f"{what} {short(str(path), 300)} is not a regular file ({_kind(st.st_mode)}); "
                         "only regular files are read")
    if max_bytes is not None and st.st_size > max_bytes:
        raise UnsafeFile(f"{what} {short(str(path), 300)} is {st.st_size} bytes, above the {max_bytes}-byte cap")
    return st


def open_regular(path: str | os.PathLike, what: str) -> int:
    """A read-only descriptor of the regular file at ``path`` (never blocks on a FIFO)."""
    check_regular(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise UnsafeFile(f"{what} {short(str(path), 300)} cannot be opened: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between the stat and the open
        os.close(fd)
        raise UnsafeFile(f"{what} {short(str(path), 300)} changed into a non-regular file while being opened")
    return fd


def read_json_file(path: str | os.PathLike, what: str, max_bytes: int = MAX_JSON_BYTES) -> JsonValue:
    """The parsed JSON of a small regular file; `UnsafeFile` naming it on any problem."""
    check_regular(path, what, max_bytes)
    fd = open_regular(path, what)
    try:
        with os.fdopen(fd, "rb", closefd=True) as f:
            raw = f.read(max_bytes + 1)
        return json.loads(raw)
    except (ValueError, RecursionError, OSError) as e:
        raise UnsafeFile(f"{what} {short(str(path), 300)} is not valid JSON: {short(str(e), 200)}") from None


def load_safetensors(path: str | os.PathLike, what: str = "weight file") -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file; a corrupt or truncated one is an `UnsafeFile` naming it."""
    from safetensors.torch import load_file

    fd = open_regular(path, what)
    try:
        # load_file opens by name; /proc/self/fd/N names the very file checked above.
        name = f"/proc/self/fd/{fd}"
        return load_file(name if os.path.exists(name) else str(path))
    except Exception as e:  # SafetensorError, OSError, ...: the library's many ways to say "bad file"
        raise UnsafeFile(f"{what} {short(str(path), 300)} is not a readable safetensors file: "
                         f"{short(str(e), 200)}") from None
    finally:
        os.close(fd)


def checkpoint_files(root: Path) -> list[Path]:
    """The safetensors files of an HF checkpoint directory: those its index names, else ``*.safetensors``.

    An index entry must be a plain relative name inside ``root`` (no absolute path, no
    ``..``): a checkpoint cannot make the server read files elsewhere.
    """
    index = root / INDEX_NAME
    if not os.path.lexists(index):
        return sorted(root.glob("*.safetensors"))
    data = read_json_file(index, "index")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UnsafeFile(f"index {index}: 'weight_map' must be an object of tensor name -> file name")
    files = []
    for name in sorted(set(weight_map.values())):
        parts = PurePosixPath(name).parts
        if not name or "\0" in name or PurePosixPath(name).is_absolute() or ".." in parts or "\\" in name:
            raise UnsafeFile(f"index {index}: file {short(name)} is outside the checkpoint directory; "
                             "an index may only name files next to it")
        files.append(root / name)
    return files


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"
