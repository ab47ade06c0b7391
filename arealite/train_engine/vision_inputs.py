"""Images in the train engine: a vision-language model (Qwen2.5-VL) built, sharded and fed.

A vision batch carries, besides the right-padded ``[B, L]`` token keys, ``pixel_values``
``[B, P, D]`` (each row's patches, right-padded with 0) and ``image_grid_thw`` ``[B, N, 3]``
(each row's image grids, all-zero rows pad); docs/vision.md. A packed micro-batch gets the
real patches and grids of its rows, concatenated in packing order, and the 3-D rotary
positions of each row (`arealite.vision.rope`) concatenated like the tokens.

The language model runs arealite's packed attention (causal within each packed sequence);
the vision tower keeps transformers' SDPA, which is non-causal within each image.

Under FSDP2 each vision block is sharded on its own: its all-gathers are collectives, so on
several ranks the i-th micro-batch must have images on every rank or on none
(`check_images_line_up`; a micro-batch without images on one rank while another's has them
is refused with an error, not yet run).
"""

from __future__ import annotations

from typing import Any

import torch

from arealite.train_engine.packing import PackedIndex
from arealite.vision.rope import mrope_positions, row_grids

__all__ = ["VISION_KEYS", "check_images_line_up", "is_vision_config", "pack_images", "split_vision_keys",
           "vision_blocks", "vision_tower"]

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


def check_images_line_up(has_images: list[bool], device: torch.device) -> None:
    """Raise unless the i-th micro-batch has images on every rank or on none (a collective)."""
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return
    flags = torch.tensor(has_images, dtype=torch.int64, device=device)
    low, high = flags.clone(), flags.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    odd = (low != high).nonzero()
    if odd.numel():
        raise ValueError(
            f"micro-batch {int(odd[0, 0])} has images on some trainer ranks and none on others; with a "
            "vision-language model on several ranks every micro-batch must have images on all ranks or on "
            "none (not yet supported otherwise): give every row an image, or train on one rank")
