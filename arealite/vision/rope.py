"""The 3-D (mrope) rotary positions of one Qwen2.5-VL row, from its token ids and image grids.

Qwen2.5-VL gives every token three positions (time, height, width): a text token has the same
running index in all three, an image's merged patches their grid coordinates offset by the
position the image starts at. The model computes them with ``get_rope_index`` over a padded
batch; a packed micro-batch needs them per row, so this wraps that same method (transformers'
own code, bound to a holder of the model config) for one row at a time.
"""

from __future__ import annotations

from typing import Any

import torch

from arealite.vision.placeholders import image_slots

__all__ = ["mrope_positions", "row_grids"]


class _RopeIndex:
    """What ``Qwen2_5_VLModel.get_rope_index`` reads from ``self``: the config and one helper."""

    def __init__(self, hf_config: Any):
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

        self.config = hf_config
        self._model_cls = Qwen2_5_VLModel

    def get_vision_position_ids(self, *args, **kwargs) -> torch.Tensor:
        return self._model_cls.get_vision_position_ids(self, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self._model_cls.get_rope_index(self, *args, **kwargs)


def row_grids(image_grid_thw: torch.Tensor) -> torch.Tensor:
    """The real ``[n, 3]`` grids of one row's ``[N, 3]`` (all-zero rows are padding)."""
    return image_grid_thw[(image_grid_thw != 0).any(dim=-1)]


def mrope_positions(hf_config: Any, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None) -> torch.Tensor:
    """Positions ``[3, L]`` of one row: ``input_ids [L]`` (the expanded prompt and what follows),
    ``image_grid_thw [N, 3]`` of its images in prompt order (all-zero rows ignored; None or none
    left: a text-only row, whose three positions are ``0..L-1``).

    The image slots are the pads of ``<|vision_start|>`` blocks; a pad elsewhere (one the policy
    generated) is text (`arealite.vision.placeholders`). Raises ValueError when the row's image
    slots do not match its grids.
    """
    L = int(input_ids.shape[0])
    grids = row_grids(image_grid_thw) if image_grid_thw is not None else None
    is_image = image_slots(input_ids, int(hf_config.image_token_id), int(hf_config.vision_start_token_id))
    if grids is None or grids.shape[0] == 0:
        if bool(is_image.any()):
            raise ValueError(f"the row has {int(is_image.sum())} image tokens but no image grid (image_grid_thw)")
        return torch.arange(L, dtype=torch.long, device=input_ids.device).expand(3, L).clone()
    merge = int(hf_config.vision_config.spatial_merge_size)
    expected = int((grids.prod(dim=-1) // merge ** 2).sum())
    if int(is_image.sum()) != expected:
        raise ValueError(f"the row has {int(is_image.sum())} image tokens but its image_grid_thw "
                         f"{grids.tolist()} makes {expected}; the ids must be the processor's expanded prompt")
    positions, _ = _RopeIndex(hf_config)(input_ids[None].long(), is_image[None].int(), image_grid_thw=grids)
    return positions[:, 0]
