"""LoRA: PEFT adapters trained on the FSDP2 engine, pushed alone to the inference servers.

- `modules`: which linear modules an adapter can target (and the error naming them);
- `peft_model`: the PEFT-wrapped causal LM the engine shards, and its adapter's tensors and
  config in PEFT's file format;
- `engine`: `LoraFSDPEngine` (only adapters train; merged weights and adapter export) and
  `AdapterOffReference` (the reference model: the same weights with adapters off);
- `files`: writing and reading a PEFT adapter directory.

See docs/lora.md.
"""

from arealite.lora.engine import AdapterOffReference, LoraFSDPEngine
from arealite.lora.modules import check_target_modules, linear_module_names

__all__ = ["AdapterOffReference", "LoraFSDPEngine", "check_target_modules", "linear_module_names"]
