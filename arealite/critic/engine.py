"""`ValueEngine`: the FSDP2 train engine with a value model instead of a causal LM.

The value model is the Hugging Face token-classification model of the backbone's
architecture with one label (``AutoModelForTokenClassification``, ``num_labels=1``): the
backbone loaded from the policy's checkpoint and a freshly initialised linear head
``hidden -> 1``. The engine's forward then hands loss functions and hooks ``[T, 1]``
values where it would hand ``[T, V]`` logits; packing, micro-batching, gradient scaling
over ranks, checkpoints and RNG state are the base engine's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from arealite.config.schema import TrainEngineConfig
from arealite.train_engine.attention import register_attention
from arealite.train_engine.fsdp import FSDPEngine
from arealite.train_engine.fsdp_model import without_dropout

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["ValueEngine", "value_model"]


def value_model(path: Path, hf_config: PretrainedConfig, attn_implementation: str | None = None) -> torch.nn.Module:
    """The backbone at ``path`` with a fresh scalar head (token classification, one label),
    every dropout off so that training scores tokens as `forward` does; packed-sequence
    attention ``attn_implementation`` (the engine passes what ``critic.attn_impl`` resolves to;
    None = the SDPA loop)."""
    from transformers import AutoModelForTokenClassification

    model_config = without_dropout(hf_config)
    model_config.num_labels = 1
    model = AutoModelForTokenClassification.from_pretrained(
        path, config=model_config, dtype=torch.float32,
        attn_implementation=attn_implementation or register_attention("sdpa_loop"),
    )
    # The head's dropout defaults to 0.1 when the config's classifier/hidden dropout is 0 (a
    # falsy value): switch every dropout off.
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    _initialise_head(model, model_config)
    return model


#: The seed of the fresh value head: the same head on every rank and in every run.
HEAD_SEED = 0


def _initialise_head(model: torch.nn.Module, hf_config: PretrainedConfig) -> None:
    """Draw the fresh head's weight from a generator of its own (as transformers initialises a
    linear layer: normal with the config's ``initializer_range``, zero bias). transformers draws
    it from each process's global RNG, so every rank held another head and FSDP2 stitched their
    shards together; now every rank, and a one-process run, start from the same head."""
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"{type(model).__name__} has no linear value head (score or classifier) to initialise")
    g = torch.Generator().manual_seed(HEAD_SEED)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * getattr(hf_config, "initializer_range", 0.02))
        if head.bias is not None:
            head.bias.zero_()


class ValueEngine(FSDPEngine):
    """An `FSDPEngine` (same contract: packing, micro-batching, gradient scaling over ranks,
    checkpoints, RNG state) whose model is a value model: ``forward`` hooks and
    ``train_batch`` loss functions receive ``[T, 1]`` values in place of logits."""

    section = "critic"
    build_model = staticmethod(value_model)

    def __init__(self, config: TrainEngineConfig, device: str = "auto"):
        super().__init__(config, frozen=False, device=device)

    def export_hf(self, path: str | os.PathLike) -> None:
        raise NotImplementedError("the critic is not exported as a Hugging Face causal LM; its state is in the "
                                  "run's checkpoints")

    def named_weight_buckets(self, bucket_bytes: int):
        raise NotImplementedError("the critic's weights are never sent to inference servers")
