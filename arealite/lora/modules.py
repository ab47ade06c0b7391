"""The modules a LoRA adapter may target: linear layers, named by the last part of their path."""

from __future__ import annotations

import torch


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct short names (``q_proj``, ``down_proj``, ...) of the model's linear layers."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and name})


def check_target_modules(model: torch.nn.Module, target_modules: list[str],
                         field: str = "actor.lora.target_modules") -> None:
    """Raise ``ValueError`` naming ``field`` and the model's linear modules when a target
    matches none of them."""
    have = linear_module_names(model)
    unknown = [t for t in target_modules if t not in have]
    if unknown:
        raise ValueError(
            f"{field}: {unknown} match no linear layer of {type(model).__name__}; "
            f"its linear modules are {have}")
