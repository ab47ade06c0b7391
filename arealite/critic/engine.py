"""`ValueEngine`: the FSDP2 train engine with a value model instead of a causal LM.

The value model is the Hugging Face token-classification model of the backbone's
architecture with one label (``AutoModelForTokenClassification``, ``num_labels=1``): the
backbone loaded from the policy's checkpoint and a freshly initialised linear head
``hidden -> 1``. The engine's forward then hands loss functions and hooks ``[T, 1]``
values where it would hand ``[T, V]`` logits; packing, micro-batching, gradient scaling
over ranks, checkpoints and RNG state are the base engine's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from arealite.config.schema import ActorConfig
from arealite.engine.fsdp import FSDPEngine
from arealite.engine.fsdp_model import build_optimizer, decoder_layers, without_dropout
from arealite.engine.packing import register_varlen_attention

__all__ = ["ValueEngine", "load_value_model"]

logger = logging.getLogger("arealite.critic")


def load_value_model(config: ActorConfig, mesh: Any, dtype: torch.dtype) -> tuple[torch.nn.Module, Any, int]:
    """The backbone at ``config.model_path`` with a scalar head, sharded with FSDP2 over ``mesh``
    (every decoder layer on its own, then the root); ``(model, hf_config, n_layers)``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForTokenClassification

    path = Path(config.model_path)
    hf_config = AutoConfig.from_pretrained(path)
    model_config = without_dropout(hf_config)
    model_config.num_labels = 1
    model = AutoModelForTokenClassification.from_pretrained(
        path, config=model_config, dtype=torch.float32, attn_implementation=register_varlen_attention(),
    )
    model.config.use_cache = False
    # The head's dropout defaults to 0.1 when the config's classifier/hidden dropout is 0 (a
    # falsy value): switch every dropout off, so training scores tokens as `forward` does.
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": mesh.size() > 1}
    if dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    model.train()
    return model, hf_config, len(layers)


class ValueEngine(FSDPEngine):
    """An `FSDPEngine` (same contract) whose model is a value model: ``forward`` hooks and
    ``train_batch`` loss functions receive ``[T, 1]`` values in place of logits."""

    def __init__(self, config: ActorConfig, device: str = "auto"):
        super().__init__(config, frozen=False, device=device)

    def initialize(self, total_steps: int | None = None) -> "ValueEngine":
        """Join the process group, load and shard the value model, build its AdamW and LR schedule."""
        if self.model is not None:
            raise RuntimeError("ValueEngine.initialize() was already called")
        if not (Path(self.config.model_path) / "config.json").is_file():
            raise FileNotFoundError(f"critic model_path={self.config.model_path!r} has no config.json; it must be "
                                    "a Hugging Face model directory")
        self._join_group()
        self.model, self.hf_config, n_layers = load_value_model(self.config, self.mesh, self.dtype)
        self._pad_id = int(self.hf_config.pad_token_id or 0)
        self.optimizer, self.lr_scheduler = build_optimizer(self.model, self.config.optimizer, total_steps)
        logger.info("ValueEngine ready: rank %d/%d, %d decoder layers sharded, dtype=%s",
                    self.rank, self.world_size, n_layers, self.dtype)
        return self

    def export_hf(self, path: Any) -> None:
        raise NotImplementedError("the critic is not exported as a Hugging Face causal LM; its state is in the "
                                  "run's checkpoints")

    def named_weight_buckets(self, bucket_bytes: int):
        raise NotImplementedError("the critic's weights are never sent to inference servers")
