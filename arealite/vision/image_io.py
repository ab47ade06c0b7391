"""One image's bytes in and out: read a source (file, ``data:`` URL, base64, bytes) into its
encoded file bytes, check or decode them within a pixel limit, and encode them as the base64
`GenerationRequest.image_data` carries.

Every failure is an `ImageError` whose message names where the image is (file, row, field or
request part): the dataset checks, the workflows, the agent endpoint and the server all read
images through here. What a dataset row may hold is `arealite.data.image_sources`.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Callable
from pathlib import Path

from arealite.data.image_sources import ImageSource, is_path

__all__ = ["ImageError", "check_pixels", "decode_image_data", "encode_base64", "image_bytes", "open_image",
           "probe_image", "read_image", "to_png_bytes"]


class ImageError(ValueError):
    """An image cannot be read, decoded, or is over a limit; the message names where it is."""


def image_bytes(source: ImageSource, where: str = "image") -> bytes:
    """The encoded file bytes (PNG, JPEG, ... as stored) of one image source. ``where`` names it
    in errors (e.g. ``data/train.jsonl:12 field 'images'[0]``)."""
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


def probe_image(data: bytes, where: str = "image", max_pixels: int | None = None) -> tuple[int, int]:
    """(width, height) of encoded image bytes, checked without decoding every pixel: the
    header names a known format, the size is within ``max_pixels``, the file is not truncated
    or corrupt as far as PIL's ``verify`` can tell. Raises `ImageError` naming ``where``."""

    def verify(img):
        img.verify()
        return img.size

    return read_image(data, where, max_pixels, verify)


def open_image(data: bytes, where: str = "image", max_pixels: int | None = None):
    """Decode encoded image bytes into an RGB ``PIL.Image``; refuse an undecodable file or one of
    more than ``max_pixels`` pixels (checked from the header, before decoding the pixels)."""
    return read_image(data, where, max_pixels, lambda img: img.convert("RGB"))


def encode_base64(data: bytes) -> str:
    """Base64 text of encoded image bytes: the form `GenerationRequest.image_data` carries."""
    return base64.b64encode(data).decode("ascii")


def to_png_bytes(image) -> bytes:
    """Encode a ``PIL.Image`` as PNG (for images made in memory, e.g. by a task generator)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def decode_image_data(text: str, where: str = "image_data", max_pixels: int | None = None):
    """One entry of `GenerationRequest.image_data` (base64, or a ``data:`` URL) as an RGB image.
    Never a file path: what a client sends must not name files on the server."""
    if text.startswith("data:"):
        data = image_bytes(text, where)
    else:
        try:
            data = base64.b64decode(text, validate=True)
        except ValueError:
            raise ImageError(f"{where}: not valid base64 ({text[:40]!r})") from None
    return open_image(data, where, max_pixels)
