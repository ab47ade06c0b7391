"""Render a prompt with images through the model's processor: the tokens the server runs and
the tensors the trainer's forward takes, made once so that both see exactly the same.

A prompt marks where each image goes with ``<image>`` in its text (a plain string, or a chat
message's content), or with ``{"type": "image"}`` content parts; the images come in that
order. The chat template turns each into ``<|vision_start|><|image_pad|><|vision_end|>`` and
the processor expands the one ``<|image_pad|>`` into one per merged patch (Qwen2.5-VL).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from arealite.vision.image_io import ImageError, encode_base64, open_image

if TYPE_CHECKING:
    import torch

#: What a prompt writes where an image goes.
IMAGE_PLACEHOLDER = "<image>"
_IMAGE_PARTS = ("image", "image_url")

#: What Qwen2.5-VL's chat template renders for one image (before the processor's expansion).
VISION_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass
class VisionPrompt:
    """One prompt with its images, as the processor made it (docs/vision.md).

    ``input_ids``: the EXPANDED prompt (one ``<|image_pad|>`` per merged patch), what a request
    sends; ``pixel_values`` float32 ``[P, D]``: every image's patches in prompt order;
    ``image_grid_thw`` int64 ``[N, 3]``: each image's (t, h, w) in patches; ``image_data``: base64
    of each image's encoded file bytes, in placeholder order (`GenerationRequest.image_data`).
    """

    input_ids: list[int]
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    image_data: list[str]


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


def _split_placeholders(text: str) -> list[dict]:
    parts: list[dict] = []
    for i, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def to_messages(prompt: str | Sequence[dict]) -> list[dict]:
    """Chat messages whose ``<image>`` placeholders are image content parts."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str) and IMAGE_PLACEHOLDER in content:
            m = {**m, "content": _split_placeholders(content)}
        out.append(m)
    return out


def prompt_text(processor, prompt: str | Sequence[dict], apply_chat_template: bool) -> str:
    """The prompt's text with one `VISION_BLOCK` per image, before the processor's expansion."""
    if isinstance(prompt, str) and not apply_chat_template:
        return prompt.replace(IMAGE_PLACEHOLDER, VISION_BLOCK)
    return processor.apply_chat_template(to_messages(prompt), add_generation_prompt=True, tokenize=False)


def render_vision_prompt(
    processor,
    prompt: str | Sequence[dict],
    images: Sequence[bytes],
    *,
    apply_chat_template: bool = True,
    max_pixels: int | None = None,
    where: str = "prompt",
) -> VisionPrompt:
    """Render ``prompt`` with ``images`` (encoded file bytes, in placeholder order) through
    ``processor`` (`arealite.vision.processor.load_processor`). Raises `ImageError` naming ``where`` when the number of
    images differs from the prompt's placeholders or an image cannot be decoded."""
    n_placeholders = count_images(prompt)
    if n_placeholders != len(images):
        raise ImageError(f"{where}: the prompt places {n_placeholders} image(s) ('{IMAGE_PLACEHOLDER}' or "
                         f"image content parts) but the row has {len(images)}")
    text = prompt_text(processor, prompt, apply_chat_template)
    pil = [open_image(b, f"{where} image {i}", max_pixels) for i, b in enumerate(images)]
    out = processor(text=[text], images=pil or None, return_tensors="pt")
    import torch

    if pil:
        pixel_values = out["pixel_values"].to(torch.float32)
        grid = out["image_grid_thw"].to(torch.int64)
    else:
        pixel_values = torch.zeros(0, _patch_dim(processor), dtype=torch.float32)
        grid = torch.zeros(0, 3, dtype=torch.int64)
    return VisionPrompt(input_ids=out["input_ids"][0].tolist(), pixel_values=pixel_values,
                        image_grid_thw=grid, image_data=[encode_base64(b) for b in images])


def _patch_dim(processor) -> int:
    ip = processor.image_processor
    return 3 * ip.temporal_patch_size * ip.patch_size ** 2


def image_token_count(grid_thw: torch.Tensor, merge_size: int = 2) -> int:
    """``<|image_pad|>`` tokens the processor expands images of ``grid_thw`` into."""
    return int((grid_thw.prod(dim=-1) // (merge_size ** 2)).sum())

