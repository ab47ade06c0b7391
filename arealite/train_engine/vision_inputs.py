"""Images in the train engine: a vision-language model (Qwen2.5-VL) built, sharded and fed.

A vision batch carries, besides the right-padded ``[B, L]`` token keys, ``pixel_values``
``[B, P, D]`` (each row's patches, right-padded with 0) and ``image_grid_thw`` ``[B, N, 3]``
(each row's image grids, all-zero rows pad); docs/vision.md. A packed micro-batch gets the
real patches and grids of its rows, concatenated in packing order, and the 3-D rotary
positions of each row (`arealite.vision.rope`) concatenated like the tokens.

The language model runs arealite's packed attention (causal within each packed sequence);
the vision tower keeps transformers' SDPA, which is non-causal within each image.

Under FSDP2 each vision block is sharded on its own: its all-gathers and reduce-scatters are
collectives, so every rank must run the tower in every micro-batch or none may. On several
ranks a micro-batch without images (a text-only row, or a dummy) therefore runs the tower on
one blank image (`blank_image`, a single merged token's patches) and adds zero times its
output to the token embeddings (`image_pass`): the same collectives as a rank with images,
gradients exactly zero, the result unchanged. Under sequence parallelism the model gets no
images; `image_pass` runs the tower on the images this rank's tokens hold and places their
features itself (`arealite.train_engine.parallel.sequence_images`). For the same reason the model's output
leaves out the tower's features (`hide_image_outputs`): FSDP2 hooks the backward of every
tensor the root module returns, and a root hook firing mid-backward on the ranks with images
alone would prefetch a layer there and nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from arealite.train_engine.packing import PackedIndex
from arealite.vision.rope import mrope_positions, row_grids

__all__ = ["VISION_KEYS", "ImageFeed", "blank_image", "hide_image_outputs", "image_pass", "is_vision_config",
           "pack_images", "split_vision_keys", "vision_blocks", "vision_tower"]

#: The batch keys that hold images (not per-token: never packed as tokens are).
VISION_KEYS = ("pixel_values", "image_grid_thw")


def is_vision_config(hf_config: Any) -> bool:
    """Whether a HF config (object or dict) is a vision-language model's (has a ``vision_config``)."""
    if isinstance(hf_config, dict):
        return "vision_config" in hf_config
    return getattr(hf_config, "vision_config", None) is not None


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's vision tower (``model.model.visual`` in transformers 5), or None."""
    if callable(getattr(model, "get_base_model", None)):  # a PEFT model: the HF model it wraps
        model = model.get_base_model()
    return getattr(getattr(model, "model", None), "visual", None)


def vision_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The vision tower's transformer blocks (sharded one by one), or [] for a text model."""
    tower = vision_tower(model)
    return list(getattr(tower, "blocks", [])) if tower is not None else []


def split_vision_keys(data: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``data`` without its image keys, and those keys (both or neither must be there)."""
    present = [k for k in VISION_KEYS if k in data]
    if not present:
        return data, {}
    if len(present) != len(VISION_KEYS):
        raise KeyError(f"the batch has {present[0]!r} but not {set(VISION_KEYS) - set(present)}; a vision batch "
                       "carries both pixel_values [B, P, D] and image_grid_thw [B, N, 3]")
    B = data["input_ids"].shape[0]
    pv, grid = data["pixel_values"], data["image_grid_thw"]
    if pv.dim() != 3 or pv.shape[0] != B or grid.dim() != 3 or grid.shape[0] != B or grid.shape[2] != 3:
        raise ValueError(f"batch pixel_values {tuple(pv.shape)} / image_grid_thw {tuple(grid.shape)} must be "
                         f"[B={B}, P, D] / [B={B}, N, 3]")
    return {k: v for k, v in data.items() if k not in VISION_KEYS}, {k: data[k] for k in VISION_KEYS}


def pack_images(images: dict[str, torch.Tensor], input_ids: torch.Tensor, index: PackedIndex,
                hf_config: Any) -> dict[str, torch.Tensor]:
    """The image inputs of a packed micro-batch: ``pixel_values [P, D]`` and ``image_grid_thw
    [n, 3]`` of its rows (in packing order; none when no row has an image), and
    ``mrope_position_ids [3, T]``, each row's 3-D positions concatenated."""
    patches, grids, positions = [], [], []
    for row, n in zip(index.rows, index.lengths):
        grid = row_grids(images["image_grid_thw"][row])
        n_patches = int(grid.prod(dim=-1).sum())
        if n_patches > images["pixel_values"].shape[1]:
            raise ValueError(f"batch row {row}: image_grid_thw {grid.tolist()} needs {n_patches} patches, "
                             f"pixel_values holds {images['pixel_values'].shape[1]}")
        patches.append(images["pixel_values"][row, :n_patches])
        grids.append(grid)
        try:
            positions.append(mrope_positions(hf_config, input_ids[row, :n], grid))
        except ValueError as e:
            raise ValueError(f"batch row {row}: {e}") from None
    out = {"mrope_position_ids": torch.cat(positions, dim=1)}
    grid = torch.cat(grids)
    if grid.shape[0]:
        out.update(pixel_values=torch.cat(patches).float(), image_grid_thw=grid)
    return out


class ImageFeed(NamedTuple):
    """What the vision tower computes inside one forward (`image_pass`) and where its features go:
    the tower runs on ``pixel_values``/``image_grid_thw``, and features ``keep`` of its output
    (merged tokens, in image order) replace the token embeddings at ``slots`` (a bool mask over
    the forward's tokens; None: none, the features are dropped)."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    keep: slice = slice(0, 0)
    slots: torch.Tensor | None = None


def blank_image(hf_config: Any, device: torch.device) -> ImageFeed:
    """The smallest image the tower takes, all zero, to be dropped: ``pixel_values [m*m, D]`` and
    ``image_grid_thw [[1, m, m]]`` (``m`` the spatial merge size: one merged token)."""
    vc = hf_config.vision_config
    m = vc.spatial_merge_size
    dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    return ImageFeed(torch.zeros(m * m, dim, device=device), torch.tensor([[1, m, m]], device=device))


def hide_image_outputs(model: torch.nn.Module) -> None:
    """Drop the vision tower's features (``image_outputs``/``video_outputs``, which transformers
    returns beside the logits) from ``model``'s output. Register it before ``fully_shard(model)``,
    so that FSDP2's output hooks run after it."""
    hidden = ("image_outputs", "video_outputs")

    def drop(_module, _args, output):
        if not any(output.get(k) is not None for k in hidden):
            return output
        return type(output)(**{k: v for k, v in output.items() if k not in hidden})

    model.register_forward_hook(drop)


@contextmanager
def image_pass(model: torch.nn.Module, feed: ImageFeed | None) -> Iterator[None]:
    """While active (``feed``: None, inactive), the model's token embedding also runs the vision
    tower on ``feed``'s images and puts the features it keeps at its slots. A feed that keeps
    nothing (`blank_image`) adds zero times the features instead, so a forward without images
    makes the tower's collectives (and gives it zero gradients) like one with."""
    if feed is None:
        yield
        return
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    inner = base.model  # Qwen2_5_VLModel: get_image_features runs the tower and its merger

    def place_features(_module, _args, embeds: torch.Tensor) -> torch.Tensor:
        out = inner.get_image_features(feed.pixel_values, feed.image_grid_thw, return_dict=True).pooler_output
        features = torch.cat(list(out)).to(embeds.dtype)
        kept = features[feed.keep]
        if kept.shape[0] == 0:
            return embeds + 0.0 * features.sum()
        slots = feed.slots.view(1, -1, 1).expand_as(embeds)
        return embeds.masked_scatter(slots, kept)

    handle = base.get_input_embeddings().register_forward_hook(place_features)
    try:
        yield
    finally:
        handle.remove()
