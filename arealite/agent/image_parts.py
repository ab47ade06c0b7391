"""Image content parts of OpenAI chat messages (``{"type": "image_url", "image_url": {"url":
...}}``): a ``data:`` URL is decoded to the image's encoded file bytes; an ``http(s)://`` URL is
refused unless ``agent.allow_remote_images``, then fetched by the endpoint off its event loop.
Errors are `RequestError` 400s naming the part (``messages[i].content[j]``)."""

from __future__ import annotations

import asyncio
import urllib.request

from arealite.agent.errors import RequestError
from arealite.utils.json_types import JsonObject, JsonValue
from arealite.vision.image_io import ImageError, image_bytes, open_image
from arealite.vision.prompt import VisionPrompt, render_vision_prompt

__all__ = ["ImagePolicy", "image_of_part", "render_images", "resolve_images"]


class ImagePolicy:
    """What the endpoint accepts: remote URLs or not, and the largest encoded image."""

    def __init__(self, allow_remote: bool = False, max_bytes: int = 8 << 20, max_pixels: int | None = None):
        self.allow_remote, self.max_bytes, self.max_pixels = allow_remote, max_bytes, max_pixels


def _url(part: JsonObject, where: str) -> str:
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url:
        raise RequestError(f"{where}.image_url.url must be a non-empty string (a data: URL)",
                           param=f"{where}.image_url.url")
    return url


def _checked(data: bytes, where: str, policy: ImagePolicy) -> bytes:
    if len(data) > policy.max_bytes:
        raise RequestError(f"{where}: the image is {len(data)} bytes, over agent.max_image_bytes="
                           f"{policy.max_bytes}", param=f"{where}.image_url.url")
    try:
        open_image(data, where, policy.max_pixels)
    except ImageError as e:
        raise RequestError(str(e), param=f"{where}.image_url.url") from None
    return data


def image_of_part(part: JsonObject, where: str, policy: ImagePolicy) -> bytes | str:
    """The encoded bytes of an ``image_url`` part, or its remote URL (to `resolve_images`)."""
    url = _url(part, where)
    if url.startswith(("http://", "https://")):
        if not policy.allow_remote:
            raise RequestError(f"{where}: remote image URLs are refused ({url[:60]!r}); send the image as a "
                               "data:image/...;base64 URL, or set agent.allow_remote_images: true",
                               param=f"{where}.image_url.url", code="unsupported_value")
        return url
    if not url.startswith("data:"):
        raise RequestError(f"{where}: an image_url must be a data: URL (or http(s) with agent.allow_remote_images), "
                           f"got {url[:40]!r}", param=f"{where}.image_url.url")
    try:
        data = image_bytes(url, where)
    except ImageError as e:
        raise RequestError(str(e), param=f"{where}.image_url.url") from None
    return _checked(data, where, policy)


def _fetch(url: str, where: str, policy: ImagePolicy) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:  # http(s) only: checked by image_of_part
            data = r.read(policy.max_bytes + 1)
    except OSError as e:
        raise RequestError(f"{where}: fetching {url[:60]!r} failed ({e})", param=f"{where}.image_url.url") from None
    return _checked(data, where, policy)


async def resolve_images(messages: list[JsonObject], policy: ImagePolicy) -> None:
    """Fetch the remote images of normalized ``messages`` in place (each message's ``images``)."""
    for i, m in enumerate(messages):
        images: JsonValue = m.get("images")
        for j, img in enumerate(images or []):
            if isinstance(img, str):
                images[j] = await asyncio.to_thread(_fetch, img, f"messages[{i}] image {j}", policy)


def render_images(processor, messages: list[JsonObject], max_pixels: int | None = None) -> VisionPrompt:
    """Normalized chat ``messages`` with images rendered through the model's ``processor``: the
    expanded prompt ids, the images as `GenerationRequest.image_data`, and the trainer's tensors."""
    if processor is None:
        raise RequestError("image_url parts need a vision-language policy; this endpoint's model has no "
                           "image processor", param="messages", code="unsupported_value")
    plain = [{k: v for k, v in m.items() if k != "images"} for m in messages]
    images = [b for m in messages for b in m.get("images", ())]
    try:
        return render_vision_prompt(processor, plain, images, max_pixels=max_pixels, where="messages")
    except ImageError as e:
        raise RequestError(str(e), param="messages") from None
