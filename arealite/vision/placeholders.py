"""Which ``<|image_pad|>`` tokens of a row stand for an image.

A prompt places an image as ``<|vision_start|>`` followed by a run of ``<|image_pad|>`` (one per
merged patch once expanded). A policy sampling at temperature 1 over the whole vocabulary can
also generate ``<|image_pad|>`` in its answer: to the server (and to SGLang, whose processor
finds images by the ``<|vision_start|>`` block) that is an ordinary token. So only a run of pads
right after ``<|vision_start|>`` is an image; the position of any other pad is text.

transformers' Qwen2.5-VL forward counts every pad as an image slot and refuses a row whose pads
outnumber its image features; `count_block_placeholders` replaces that count on a model
instance, so the server's and the trainer's forwards agree with the positions
(`arealite.vision.rope`) on what is an image.
"""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["count_block_placeholders", "image_slots"]


def image_slots(input_ids: torch.Tensor, image_token_id: int, vision_start_id: int) -> torch.Tensor:
    """Bool mask, the shape of ``input_ids`` (any leading dims, tokens last): the pads of runs
    that directly follow ``<|vision_start|>``."""
    pad = input_ids == image_token_id
    before = torch.nn.functional.pad(input_ids[..., :-1], (1, 0), value=-1)
    starts = pad & (before != image_token_id)  # the first pad of each run
    run = torch.cumsum(starts.long(), dim=-1)  # run number of each token (within its row)
    opened = starts & (before == vision_start_id)
    # A run is an image when its first pad follows <|vision_start|>: broadcast that to the run.
    good = torch.zeros(*run.shape[:-1], int(run.max()) + 1 if run.numel() else 1,
                       dtype=torch.bool, device=input_ids.device)
    good.scatter_(-1, run * opened, opened)
    good[..., 0] = False
    return pad & torch.gather(good, -1, run)


def count_block_placeholders(model: torch.nn.Module) -> None:
    """Make ``model``'s placeholder mask (Qwen2.5-VL's ``get_placeholder_mask``) take only the
    pads of ``<|vision_start|>`` blocks as image slots (see the module's docstring)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    inner = base.model
    original = type(inner).get_placeholder_mask
    cfg = inner.config

    def get_placeholder_mask(self: Any, input_ids, inputs_embeds, image_features=None, video_features=None):
        if input_ids is not None:  # the stray pads get another id for the mask only (embeddings untouched)
            pad = int(cfg.image_token_id)
            stray = (input_ids == pad) & ~image_slots(input_ids, pad, int(cfg.vision_start_token_id))
            input_ids = input_ids.masked_fill(stray, -1)
        return original(self, input_ids, inputs_embeds, image_features, video_features)

    inner.get_placeholder_mask = types.MethodType(get_placeholder_mask, inner)
