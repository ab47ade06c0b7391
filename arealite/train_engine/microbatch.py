"""From the batch a caller hands a train engine to the model inputs of each micro-batch.

`MicroBatchPlanner` checks the batch (a right-padded ``[B, L]`` TensorDict or dict), gathers the
rows of the rank's model-parallel group when it has one (`arealite.train_engine.parallel.row_gather`),
packs the rows into micro-batches under the token budget (every rank the same count, so that
FSDP2's collectives line up: a rank short of real micro-batches gets dummies), and builds the
model's keyword inputs for each (this rank's share of the tokens under sequence parallelism).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from arealite.api.contracts import MicroBatch, TrainBatch
from arealite.train_engine.packing import PackedIndex, pack, sequence_lengths, split_into_microbatches
from arealite.train_engine.parallel.row_gather import GroupRows, gather_rows
from arealite.train_engine.parallel.sequence import SequenceParallel
from arealite.train_engine.parallel.sequence_images import local_images, packed_image_slots
from arealite.train_engine.vision_inputs import ImageFeed, blank_image, pack_images, split_vision_keys

__all__ = ["MicroBatchPlanner", "PackedMicroBatch", "as_tensor_dict"]


class PackedMicroBatch(NamedTuple):
    """One entry of `MicroBatchPlanner.plan`: a micro-batch's packed tensors and the index that
    says which rows they came from, or ``(None, None)``: a dummy, which a rank short of real
    micro-batches runs so that the collectives of every rank line up."""

    #: The packed tensors on the engine's device: the ``mb`` a loss function or hook gets
    #: (`arealite.api.contracts.MicroBatch`, layout in docs/internals.md); None for a dummy.
    tensors: MicroBatch | None
    #: Where each packed sequence came from and how long it is; None for a dummy.
    index: PackedIndex | None


def as_tensor_dict(batch: TrainBatch) -> dict[str, torch.Tensor]:
    """The batch's tensors as a flat dict; non-tensor entries are not per-token data and are left out."""
    keys = list(batch.keys())
    data = {k: batch[k] for k in keys if isinstance(batch[k], torch.Tensor)}
    for need in ("input_ids", "attention_mask"):
        if need not in data:
            raise KeyError(f"batch has no '{need}' (keys: {sorted(keys)}); both are required")
    if data["input_ids"].dim() != 2:
        raise ValueError(f"batch 'input_ids' must be [B, L], got shape {tuple(data['input_ids'].shape)}")
    if data["attention_mask"].shape != data["input_ids"].shape:
        raise ValueError(
            f"batch 'attention_mask' has shape {tuple(data['attention_mask'].shape)}, "
            f"'input_ids' has {tuple(data['input_ids'].shape)}; they must match"
        )
    return data


class MicroBatchPlanner:
    """Micro-batches of ``max_tokens`` tokens on ``device``; ``group``: the rank's model-parallel
    group (None: data parallelism alone); ``sp``: its sequence-parallel split (None: whole rows)."""

    def __init__(self, max_tokens: int, device: torch.device, pad_id: int,
                 group: dist.ProcessGroup | None = None, sp: SequenceParallel | None = None,
                 hf_config=None):
        self.max_tokens, self.device, self.pad_id = max_tokens, device, pad_id
        self.group, self.sp = group, sp
        self.hf_config = hf_config  # a vision-language model's config (images are packed), else None

    def rows(self, batch: TrainBatch) -> GroupRows:
        """The rows this rank computes: its own, or those of its whole model-parallel group."""
        data = as_tensor_dict(batch)
        if self.group is None:
            return GroupRows(data, start=0, shape=tuple(data["input_ids"].shape))
        return gather_rows(data, self.group)

    def plan(self, data: dict[str, torch.Tensor]) -> list[PackedMicroBatch]:
        """Pack the rows into micro-batches; every rank gets the same count (the ranks of a
        model-parallel group, given the same rows, the same micro-batches). A collective. A vision
        batch's micro-batches also get their rows' images and 3-D positions (`pack_images`)."""
        data, images = split_vision_keys(data)
        if images and self.hf_config is None:
            raise ValueError("the batch has images (pixel_values) but the model is not a vision-language model")
        lengths = sequence_lengths(data["attention_mask"]).tolist()
        for r, n in enumerate(lengths):
            if n == 0:
                raise ValueError(f"batch row {r} has no real tokens (attention_mask all 0); drop it before training")
        groups = split_into_microbatches(lengths, self.max_tokens)
        count = torch.tensor([len(groups)], dtype=torch.int64, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        n_mb = int(count.item())
        if n_mb == 0:
            raise ValueError("the batch is empty on every rank: nothing to compute")
        if n_mb > len(groups):
            groups = split_into_microbatches(lengths, self.max_tokens, min_count=n_mb)
        plan: list[PackedMicroBatch] = []
        for rows in groups:
            if rows:
                mb, index = pack(data, rows, lengths)
                if images:
                    mb.update(pack_images(images, data["input_ids"], index, self.hf_config))
                plan.append(PackedMicroBatch({k: v.to(self.device) for k, v in mb.items()}, index))
            else:
                plan.append(PackedMicroBatch(None, None))
        return plan

    def image_feed(self, mb: dict | None) -> ImageFeed | None:
        """What the vision tower computes in a micro-batch's forward beside the model's inputs
        (`vision_inputs.image_pass`), or None: a text model, or the model takes the micro-batch's
        images itself. Under sequence parallelism the images this rank's tokens hold; a blank
        image where a forward on several ranks holds none (the tower's collectives)."""
        if self.hf_config is None or dist.get_world_size() == 1:
            return None
        has_images = mb is not None and "pixel_values" in mb
        if self.sp is None:
            return None if has_images else blank_image(self.hf_config, self.device)
        if has_images:
            slots = packed_image_slots(mb["input_ids"], mb["cu_seqlens"], self.hf_config)
            share = self.sp.token_range(slots.shape[0])
            feed = local_images(slots, mb["pixel_values"], mb["image_grid_thw"],
                                int(self.hf_config.vision_config.spatial_merge_size), share)
            if feed is not None:
                return feed
        return blank_image(self.hf_config, self.device)

    def model_inputs(self, mb: dict | None, index: PackedIndex | None) -> tuple[dict[str, torch.Tensor | int], int]:
        """The model's keyword inputs for a packed micro-batch (this rank's share of it under
        sequence parallelism) and the micro-batch's token count. A dummy is one pad token."""
        if mb is None:
            ids, pos, cu, max_len = torch.tensor([self.pad_id], device=self.device), None, None, None
        else:
            # The attention function reads the boundaries from cu_seq_lens_q and the longest
            # sequence from max_length_q (the keywords transformers' varlen attention paths use).
            ids, pos, cu, max_len = mb["input_ids"], mb["position_ids"], mb["cu_seqlens"], max(index.lengths)
        if pos is None:
            pos = torch.zeros_like(ids)
        mrope = mb is not None and "mrope_position_ids" in mb
        if mrope:
            # Qwen2.5-VL's packed form: the text positions (sequence starts), then the 3-D ones.
            pos = torch.cat([pos[None], mb["mrope_position_ids"]])
        if self.sp is not None:  # the images go in through image_feed
            return self.sp.local_inputs(ids, pos, cu, max_len)
        kwargs: dict[str, torch.Tensor | int] = {"input_ids": ids[None],
                                                 "position_ids": pos[:, None] if mrope else pos[None]}
        if cu is not None:
            kwargs.update(cu_seq_lens_q=cu, max_length_q=max_len)
        if mb is not None and "pixel_values" in mb:
            kwargs.update(pixel_values=mb["pixel_values"], image_grid_thw=mb["image_grid_thw"])
        return kwargs, ids.shape[0]
