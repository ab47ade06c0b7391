"""A dataset's images, checked before a run starts (docs/vision.md): every image readable and
decodable, within ``data.max_image_pixels``, one per placeholder of its prompt; and, with a
vision-language model, the tokens the images expand into, which count toward the prompt lengths
that `arealite.data.validate.validate_datasets` checks. The trainer's builder runs both
(`arealite.trainer.build.load_data`): data is a ground package and never imports vision.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from arealite.data.dataset import DatasetError
from arealite.data.image_sources import as_list
from arealite.data.validate import SHOW_ROWS, read_hf_config
from arealite.utils.json_types import JsonObject
from arealite.vision.image_io import ImageError, image_bytes, probe_image
from arealite.vision.prompt import count_images

if TYPE_CHECKING:
    from arealite.config.schema import ArealiteConfig

__all__ = ["dataset_image_tokens", "has_images", "validate_images"]


def dataset_image_tokens(cfg: ArealiteConfig, train_items: Sequence[JsonObject],
                         eval_items: Sequence[JsonObject] = ()) -> dict[str, list[int]] | None:
    """For a vision-language model or data with images: check every row's images (`validate_images`)
    and return each dataset's image tokens per row (``{"train": [...], "eval": [...]}``, the
    ``extra_tokens`` of `validate_datasets`; 0 per row without a vision model); else None."""
    key = cfg.data.image_key
    vision = "vision_config" in read_hf_config(Path(cfg.actor.model_path))
    if not vision and not has_images(train_items, key) and not has_images(eval_items, key):
        return None
    counter = None
    if vision:
        from arealite.vision.processor import image_token_counter

        counter = image_token_counter(cfg.actor.model_path)
    splits = {"train": train_items, "eval": eval_items} if eval_items else {"train": train_items}
    return {split: validate_images(items, image_key=key, prompt_key=cfg.data.prompt_key,
                                   max_pixels=cfg.data.max_image_pixels, image_tokens=counter,
                                   dataset=cfg.data.describe(split))
            for split, items in splits.items()}


def has_images(items: Sequence[JsonObject], image_key: str) -> bool:
    """Whether any row of ``items`` holds the image field."""
    return any(isinstance(it, dict) and it.get(image_key) is not None for it in items)


def validate_images(
    items: Sequence[JsonObject],
    *,
    image_key: str = "images",
    prompt_key: str = "prompt",
    max_pixels: int | None = None,
    image_tokens: Callable[[int, int], int] | None = None,
    dataset: str = "dataset",
) -> list[int]:
    """Check the images of every row: each readable and decodable, within ``max_pixels``
    (``data.max_image_pixels``), as many as the prompt's placeholders. Return each row's image
    token count (0 without ``image_tokens``, a ``count(width, height)``), or raise
    ``DatasetError`` listing every bad row by file, line (or row) and field."""
    bad: list[str] = []
    tokens = [0] * len(items)
    for i, item in enumerate(items):
        if not isinstance(item, dict) or "input_ids" in item:
            continue  # token-in rows and malformed rows: the prompt checks report those
        where = items.where(i) if hasattr(items, "where") else f"row {i}"
        sources = as_list(item.get(image_key))
        placed = count_images(item.get(prompt_key, ""))
        if placed != len(sources):
            bad.append(f"{where}: field '{prompt_key}' places {placed} image(s) ('<image>' or image "
                       f"content parts) but field '{image_key}' holds {len(sources)}")
            continue
        for j, source in enumerate(sources):
            try:
                w, h = probe_image(image_bytes(source, f"{where} field '{image_key}'[{j}]"),
                                   f"{where} field '{image_key}'[{j}]", max_pixels)
            except ImageError as e:
                bad.append(str(e))
                break
            if image_tokens is not None:
                tokens[i] += image_tokens(w, h)
    if bad:
        lines = [f"{dataset}: {len(bad)} of {len(items)} rows have unusable images:"]
        lines += [f"  {b}" for b in bad[:SHOW_ROWS]]
        if len(bad) > SHOW_ROWS:
            lines.append(f"  ... and {len(bad) - SHOW_ROWS} more")
        lines.append("Fix: give each row one image per placeholder, as a file path (relative to the data "
                     "file), base64, a data URL or bytes, within data.max_image_pixels.")
        raise DatasetError("\n".join(lines))
    return tokens
