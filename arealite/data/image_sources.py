"""Where a dataset row keeps its images (docs/vision.md).

A row names an image by a file path (relative to the data file), a ``data:`` URL, a base64
string, raw bytes (a Parquet binary column) or a ``{"bytes", "path"}`` dict (what
``datasets``' ``Image`` feature stores). This module only says what a row holds and makes its
paths absolute when the rows are loaded; reading, decoding and checking the images is
`arealite.vision.image_io`, and the checks of a dataset's images before a run are
`arealite.vision.dataset_checks`.
"""

from __future__ import annotations

import os
from pathlib import Path

#: What a dataset row may hold for one image.
ImageSource = str | bytes | bytearray | dict


def is_path(value: str) -> bool:
    """Whether a string names a file rather than holding base64 or a data URL: it has a '.'
    (base64 never does) and is not a ``data:`` URL."""
    return not value.startswith("data:") and "." in value


def resolve_paths(sources: list[ImageSource], base_dir: str | os.PathLike) -> list[ImageSource]:
    """``sources`` with each relative path made absolute against ``base_dir`` (the data
    file's folder), so that a row means the same image wherever the run starts."""
    out: list[ImageSource] = []
    for s in sources:
        if isinstance(s, str) and is_path(s) and not os.path.isabs(s):
            s = str(Path(base_dir) / s)
        elif isinstance(s, dict) and isinstance(s.get("path"), str) and not s.get("bytes") \
                and not os.path.isabs(s["path"]):
            s = {**s, "path": str(Path(base_dir) / s["path"])}
        out.append(s)
    return out


def as_list(value: object) -> list[ImageSource]:
    """A row's image field as a list (one image may be given bare)."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
