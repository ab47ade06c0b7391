"""`LoraFSDPEngine`: the FSDP2 train engine training PEFT LoRA adapters on a frozen base.

Only the adapters' parameters require gradients, so only they have gradients, optimizer
state and a share of the gradient norm; packing, micro-batching, the loss scaling over
ranks, checkpoints (DCP: the frozen base is saved too, so a checkpoint stands alone) and
RNG state are the base engine's. What leaves the engine:

- ``adapter_buckets``: the adapter's tensors in PEFT's names (what the LoRA weight push sends);
- ``named_weight_buckets``: the merged weights in HF names (``W + B @ A * alpha / r``), so
  the full-weight transfers and read-back work unchanged;
- ``export_hf(path)``: the PEFT adapter directory; ``export_hf(path, merged=True)`` a
  full HF model directory with the adapter merged in.

`AdapterOffReference` is the reference model of a KL term: the engine's own forward with
the adapters disabled (the base weights), so no second copy of the weights is loaded.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from arealite.api.contracts import PostHook, TrainBatch
from arealite.config.schema import ActorConfig
from arealite.train_engine.fsdp import FSDPEngine
from arealite.train_engine.fsdp_checkpoint import tied_duplicate_names, write_hf_dir
from arealite.lora import peft_model
from arealite.lora.files import write_adapter_dir
from arealite.utils.buckets import buckets_of
from arealite.utils.json_types import JsonObject

__all__ = ["AdapterOffReference", "LoraFSDPEngine"]


class LoraFSDPEngine(FSDPEngine):
    """An `FSDPEngine` whose model is the base with PEFT LoRA adapters (``config.lora``)."""

    def __init__(self, config: ActorConfig, device: str = "auto"):
        if config.lora is None:
            raise ValueError(f"{self.section}.lora is null: LoraFSDPEngine needs LoRA settings")
        super().__init__(config, frozen=False, device=device)
        self.lora = config.lora
        self.build_model = functools.partial(peft_model.lora_causal_lm, lora=config.lora)

    # ------------------------------------------------------------ what leaves

    def adapter_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The adapter's full tensors in PEFT's names, in buckets (a collective: every rank
        iterates to the end)."""
        self._require()
        yield from buckets_of(peft_model.adapter_tensors(self.model, self.device), bucket_bytes)

    def adapter_config(self) -> JsonObject:
        """The adapter's ``adapter_config.json``."""
        self._require()
        return peft_model.adapter_config(self.model, str(self.config.model_path))

    def named_weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The merged weights (base plus adapter) in HF names, in buckets (a collective)."""
        self._require()
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0 (weight_sync.bucket_size_mb)")
        skip = tied_duplicate_names(self.hf_config)
        yield from buckets_of(peft_model.merged_weights(self.model, self.device, skip), bucket_bytes)

    def export_hf(self, path: str | os.PathLike, merged: bool = False) -> None:
        """Write the PEFT adapter directory at ``path`` (rank 0; every rank calls it); with
        ``merged`` a full HF model directory with the adapter merged in instead."""
        self._require()
        path = Path(path)
        if merged:
            skip = tied_duplicate_names(self.hf_config)
            weights = {k: v.to("cpu") for k, v in peft_model.merged_weights(self.model, self.device, skip)}
            if self.rank == 0:
                write_hf_dir(path, weights, Path(self.config.model_path), self.hf_config)
            dist.barrier()
            return
        tensors = list(peft_model.adapter_tensors(self.model, self.device))
        if self.rank == 0:
            write_adapter_dir(path, tensors, self.adapter_config())
        dist.barrier()

    def reference(self) -> "AdapterOffReference":
        """The reference model: this engine with adapters off."""
        return AdapterOffReference(self)


class AdapterOffReference:
    """The reference model of a LoRA run: ``engine.forward`` with the adapters disabled.

    Only ``forward`` (and versioning, as a frozen engine) is offered; training goes through
    the engine itself."""

    frozen = True

    def __init__(self, engine: LoraFSDPEngine):
        self.engine = engine

    @property
    def config(self) -> ActorConfig:
        return self.engine.config

    def forward(self, batch: TrainBatch, post_hook: PostHook, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Per-token values of the base model (adapters off), as `FSDPEngine.forward`."""
        with self.engine.model.disable_adapter():
            return self.engine.forward(batch, post_hook, out_dtype)

    def get_version(self) -> int:
        return 0

    def set_version(self, version: int) -> None:
        pass

    def destroy(self) -> None:
        pass
