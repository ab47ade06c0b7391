"""A vision-language model under sequence parallelism: each rank's share of the image features.

The image tokens split like any other tokens: each rank of a sequence-parallel group runs the
language model on its consecutive share of the packed micro-batch (`sequence`), so it needs the
features of the image slots in its share, no more, and a run of slots may be cut by the split.
The model gets no images under sp: `vision_inputs.image_pass` runs the vision tower on the images
overlapping the rank's tokens (the tower attends within each image only, so an image's features
do not depend on which others run beside it) and puts the features of the rank's own slots in
place of their token embeddings. An image cut by a split runs on both ranks, each keeping its part.

The gradient: every rank computes the same loss from the gathered log-probs, and the gather's
backward hands each rank the gradient of its own tokens, so each rank's tower gradient is that
of the features its own slots took. FSDP2 sums the ranks' gradients (the engine's loss scale
cancels its averaging), so the tower gets the gradient of the whole micro-batch's features once.

A rank whose share holds no image slot runs the tower on a blank image and drops its features
(`vision_inputs.blank_image`): the tower's blocks are FSDP2 units, whose all-gathers every rank
makes together. Running the whole micro-batch's images on every rank would work as well; own
images cost each rank about ``1/sp`` of the tower's time and activation memory instead of all
of it (docs/vision.md, "Sequence parallelism", has the measurement).
"""

from __future__ import annotations

from typing import Any

import torch

from arealite.train_engine.vision_inputs import ImageFeed
from arealite.vision.placeholders import image_slots

__all__ = ["local_images", "packed_image_slots"]


def packed_image_slots(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, hf_config: Any) -> torch.Tensor:
    """Bool ``[T]``: the image slots of a packed micro-batch (each packed sequence's pads of
    ``<|vision_start|>`` blocks, `arealite.vision.placeholders`)."""
    pad, start = int(hf_config.image_token_id), int(hf_config.vision_start_token_id)
    bounds = cu_seqlens.tolist()
    return torch.cat([image_slots(input_ids[a:b], pad, start) for a, b in zip(bounds[:-1], bounds[1:])])


def local_images(slots: torch.Tensor, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, merge: int,
                 share: slice) -> ImageFeed | None:
    """The images the tokens ``share`` of a packed micro-batch hold, and which of their features
    go where: ``slots [T]`` the micro-batch's image slots, ``pixel_values [P, D]`` and
    ``image_grid_thw [n, 3]`` its images (in slot order), ``merge`` the spatial merge size.
    None when the share holds no image slot."""
    patches = image_grid_thw.prod(dim=-1)
    n_features = (patches // merge ** 2).tolist()
    if sum(n_features) != int(slots.sum()):
        raise ValueError(f"the micro-batch has {int(slots.sum())} image slots but its image_grid_thw "
                         f"{image_grid_thw.tolist()} makes {sum(n_features)} image features")
    # Feature k of the micro-batch (images' merged tokens, concatenated) fills slot k.
    first = int(slots[:share.start].sum())
    mine = slots[share]
    last = first + int(mine.sum())
    if last == first:
        return None
    ends = torch.tensor(n_features).cumsum(0).tolist()
    starts = [e - n for e, n in zip(ends, n_features)]
    own = [i for i, (a, b) in enumerate(zip(starts, ends)) if a < last and b > first]
    patch_ends = patches.cumsum(0).tolist()
    lo, hi = own[0], own[-1]
    patch_lo = patch_ends[lo] - int(patches[lo])
    local_slots = torch.cat([mine, mine.new_zeros(share.stop - share.start - mine.shape[0])])
    return ImageFeed(pixel_values[patch_lo:patch_ends[hi]], image_grid_thw[lo:hi + 1],
                     keep=slice(first - starts[lo], last - starts[lo]), slots=local_slots)
