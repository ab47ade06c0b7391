"""Images for the processor and for requests: decode encoded bytes into an RGB image (within
a pixel limit), encode them as the base64 `GenerationRequest.image_data` carries.

Where a dataset keeps an image (paths, base64, bytes) and the checks before a run are
`arealite.data.images`; the errors of both are `ImageError`, naming file, row and field.
"""

from __future__ import annotations

import base64
import io

from arealite.data.images import ImageError, image_bytes, read_image

__all__ = ["ImageError", "decode_image_data", "encode_base64", "image_bytes", "open_image", "to_png_bytes"]


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
