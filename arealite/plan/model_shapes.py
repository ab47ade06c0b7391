"""The parameters of the model a run trains, by role and by the split that applies to each.

The model is built on the meta device from its config.json alone (no weights are read, so a
directory holding only config.json plans, and so does a config dict), with the classes the
engine builds: a causal LM (`arealite.train_engine.fsdp_model.causal_lm`), the critic's value
model (`arealite.critic.engine.value_model`: token classification with one label), a
vision-language model, and LoRA adapters on top (`arealite.lora.peft_model`). Every parameter
gets a role (embedding, attention, mlp, norm, experts, router, final_norm, head, vision,
value_head, lora), its decoder layer (None for the root's and the vision tower's) and the split
that applies to it on a trainer rank:

- ``column`` / ``row``: tensor parallelism splits dim 0 / dim 1 (`parallel.tensor`'s plan);
- ``experts``: expert parallelism splits dim 0 (the experts) and FSDP2 leaves it alone
  (`parallel.experts`), when ``ep_size > 1``;
- ``whole``: only FSDP2's dim-0 shard (every parameter gets that one, over ``dp_shard x sp``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from arealite.config.schema import LoraConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["ModelShapes", "ParamShape", "load_hf_config", "meta_model", "model_shapes"]

#: The projections tensor parallelism splits, by the last two parts of their module path.
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class ParamShape:
    """One parameter of the model (a tied weight appears once, under its first name)."""

    name: str
    shape: tuple[int, ...]
    role: str
    layer: int | None
    split: str
    trainable: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ModelShapes:
    """The parameter inventory of a model (see the module's docstring)."""

    params: list[ParamShape]
    n_layers: int
    tied: bool
    hf_config: dict = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def layer(self, i: int) -> list[ParamShape]:
        """The parameters of decoder layer ``i``."""
        return [p for p in self.params if p.layer == i]

    def root(self) -> list[ParamShape]:
        """What FSDP2's root module holds: every parameter outside the decoder layers and the
        vision tower's blocks (embeddings, final norm, output or value head, the tower's rest)."""
        return [p for p in self.params if p.layer is None and not (p.role == "vision" and ".blocks." in p.name)]

    def vision_blocks(self) -> dict[str, list[ParamShape]]:
        """The vision tower's blocks (each one FSDP2 unit), by block path."""
        blocks: dict[str, list[ParamShape]] = {}
        for p in self.params:
            if p.role == "vision" and (m := re.search(r"^(.*\.blocks\.\d+)\.", p.name)):
                blocks.setdefault(m.group(1), []).append(p)
        return blocks

    def by_role(self) -> dict[str, int]:
        """Parameter counts per role."""
        out: dict[str, int] = {}
        for p in self.params:
            out[p.role] = out.get(p.role, 0) + p.numel
        return out


def load_hf_config(source: str | Path | dict) -> PretrainedConfig:
    """The transformers config of a model directory (its config.json only), of a config.json
    file, or of a config dict."""
    from transformers import AutoConfig

    if isinstance(source, dict):
        raw = dict(source)
    else:
        path = Path(source)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"{path} has no config.json: the planner reads the model's shapes from it")
        raw = json.loads(file.read_text())
    model_type = raw.pop("model_type", None)
    if model_type is None:
        raise ValueError("the model's config has no model_type; it must be a Hugging Face config.json")
    return AutoConfig.for_model(model_type, **raw)


def _is_vision(hf_config: PretrainedConfig) -> bool:
    return getattr(hf_config, "vision_config", None) is not None


def meta_model(hf_config: PretrainedConfig, *, value_model: bool = False, lora: LoraConfig | None = None,
               attn_implementation: str | None = None, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The module the engine trains, on the meta device (no memory, no weights read)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForTokenClassification

    from arealite.train_engine.fsdp_model import without_dropout

    config = without_dropout(hf_config)
    kwargs = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with torch.device("meta"):
        if value_model:
            config.num_labels = 1
            model = AutoModelForTokenClassification.from_config(config, **kwargs)
        elif _is_vision(config):
            model = AutoModelForImageTextToText.from_config(config, **kwargs)
        else:
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        if lora is not None:
            from peft import LoraConfig as PeftLoraConfig
            from peft import get_peft_model

            peft_cfg = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                      target_modules=list(lora.target_modules), bias="none")
            model = get_peft_model(model, peft_cfg)
    return model


def _role(name: str, is_moe_block: bool) -> str:
    if ".lora_A." in name or ".lora_B." in name:
        return "lora"
    if "visual." in name or "vision_tower." in name or "vision_model." in name:
        return "vision"
    if "embed_tokens" in name:
        return "embedding"
    if "lm_head" in name:
        return "head"
    if name.split(".")[-2] in ("score", "classifier"):
        return "value_head"
    if _LAYER.search(name) is None:
        return "final_norm" if "norm" in name else "other"
    if ".mlp.experts." in name:
        return "experts"
    if is_moe_block and ".mlp.gate." in name:
        return "router"
    if "norm" in name.rsplit(".", 2)[-2]:
        return "norm"
    if ".self_attn." in name:
        return "attention"
    return "mlp"


def _split(name: str, role: str) -> str:
    if role == "experts":
        return "experts"
    if role not in ("attention", "mlp"):
        return "whole"
    owner = name.replace(".base_layer.", ".").rsplit(".", 2)[-2]
    return "column" if owner in _COLUMN else "row" if owner in _ROW else "whole"


def model_shapes(source: str | Path | dict | PretrainedConfig, *, value_model: bool = False,
                 lora: LoraConfig | None = None) -> ModelShapes:
    """The parameter inventory of the model at ``source`` (a directory, a config.json, a config
    dict or a transformers config), as the engine builds it (see `meta_model`)."""
    hf_config = source if hasattr(source, "to_dict") else load_hf_config(source)
    model = meta_model(hf_config, value_model=value_model, lora=lora)
    moe = any(".mlp.experts." in n for n, _ in model.named_parameters())
    params = []
    for name, p in model.named_parameters():
        role = _role(name, moe)
        m = _LAYER.search(name)
        layer = int(m.group(1)) if m and role != "vision" else None
        params.append(ParamShape(name, tuple(p.shape), role, layer, _split(name, role),
                                 trainable=(role == "lora") if lora is not None else True))
    from arealite.train_engine.fsdp_model import decoder_layers

    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    tied = bool(getattr(hf_config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))
    return ModelShapes(params, len(decoder_layers(model)), tied and not value_model, hf_config.to_dict())
