"""A dataset's images: where a row keeps them and whether each is usable (docs/vision.md).

A row names an image by a file path (relative to the data file), a ``data:`` URL, a base64
string, raw bytes (a Parquet binary column) or a ``{"bytes", "path"}`` dict (what
``datasets``' ``Image`` feature stores); the prompt marks where each goes with ``<image>``
(or ``{"type": "image"}`` content parts). `image_bytes` returns the encoded file bytes
(PNG, JPEG, ... as stored: what a request carries and the server decodes), `probe_image`
checks them; `arealite.data.validate.validate_images` runs the checks on every row.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from collections.abc import Callable, Sequence
from pathlib import Path

#: What a dataset prompt writes where an image goes.
IMAGE_PLACEHOLDER = "<image>"
_IMAGE_PARTS = ("image", "image_url")

#: What a dataset row may hold for one image.
ImageSource = str | bytes | bytearray | dict


class ImageError(ValueError):
    """An image cannot be read, decoded, or is over a limit; the message names where it is."""


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


def image_bytes(source: ImageSource, where: str = "image") -> bytes:
    """The encoded file bytes of one image source. ``where`` names it in errors
    (e.g. ``data/train.jsonl:12 field 'images'[0]``)."""
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if isinstance(source, dict):  # datasets' Image feature: {"bytes": ..., "path": ...}
        if source.get("bytes"):
            return bytes(source["bytes"])
        if isinstance(source.get("path"), str):
            return _read_file(source["path"], where)
        raise ImageError(f"{where}: an image dict needs 'bytes' or 'path', got keys {sorted(source)}")
    if not isinstance(source, str):
        raise ImageError(f"{where}: an image must be a path, base64, a data URL or bytes, "
                         f"got {type(source).__name__}")
    if source.startswith("data:"):
        head, sep, payload = source.partition(",")
        if not sep or ";base64" not in head:
            raise ImageError(f"{where}: a data URL must be 'data:image/<type>;base64,<data>', got {source[:40]!r}")
        return _b64decode(payload, where)
    if is_path(source):
        return _read_file(source, where)
    return _b64decode(source, where)


def _read_file(path: str, where: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise ImageError(f"{where}: image file not found: {path}") from None
    except OSError as e:
        raise ImageError(f"{where}: cannot read image file {path} ({e.strerror})") from None


def _b64decode(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{where}: neither an image file path (no '.' suffix) nor valid base64: "
                         f"{text[:40]!r}") from None


def probe_image(data: bytes, where: str = "image", max_pixels: int | None = None) -> tuple[int, int]:
    """(width, height) of encoded image bytes, checked without decoding every pixel: the
    header names a known format, the size is within ``max_pixels``, the file is not truncated
    or corrupt as far as PIL's ``verify`` can tell. Raises `ImageError` naming ``where``."""

    def verify(img):
        img.verify()
        return img.size

    return read_image(data, where, max_pixels, verify)


def read_image(data: bytes, where: str, max_pixels: int | None, use: Callable):
    """``use(img)`` on the ``PIL.Image`` of encoded ``data``, once its header says it is an image
    of at most ``max_pixels`` pixels; every PIL failure becomes an `ImageError` naming ``where``."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            check_pixels(img.size, where, max_pixels)
            return use(img)
    except UnidentifiedImageError:
        raise ImageError(f"{where}: not a decodable image ({len(data)} bytes; PNG, JPEG, GIF, BMP, WebP...)") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        if isinstance(e, ImageError):
            raise
        raise ImageError(f"{where}: cannot decode the image ({e})") from None


def check_pixels(size: tuple[int, int], where: str, max_pixels: int | None) -> None:
    """Refuse an image of ``size`` (width, height) with more than ``max_pixels`` pixels."""
    w, h = size
    if w < 1 or h < 1:
        raise ImageError(f"{where}: the image is empty ({w}x{h})")
    if max_pixels is not None and w * h > max_pixels:
        raise ImageError(f"{where}: {w}x{h} = {w * h} pixels > data.max_image_pixels = {max_pixels}; "
                         "downscale the image or raise data.max_image_pixels")


def count_images(prompt: str | Sequence[dict]) -> int:
    """How many images a prompt places: ``<image>`` in its text and image content parts."""
    if isinstance(prompt, str):
        return prompt.count(IMAGE_PLACEHOLDER)
    if not isinstance(prompt, (list, tuple)):
        return 0
    n = 0
    for m in prompt:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            n += content.count(IMAGE_PLACEHOLDER)
        elif isinstance(content, list):
            n += sum(1 for p in content if isinstance(p, dict) and p.get("type") in _IMAGE_PARTS)
    return n


def image_token_counter(model: str | os.PathLike | object) -> Callable[[int, int], int]:
    """``count(width, height)``: the ``<|image_pad|>`` tokens one image of that size expands into
    with the model's image processor (its resize, patch and merge sizes). ``model``: the model
    directory, or its image processor already loaded."""
    if hasattr(model, "merge_size"):
        ip = model
    else:
        from transformers import AutoImageProcessor

        ip = AutoImageProcessor.from_pretrained(model)
    merge = ip.merge_size

    def count(width: int, height: int) -> int:
        return ip.get_number_of_image_patches(height, width, {}) // (merge * merge)

    return count
