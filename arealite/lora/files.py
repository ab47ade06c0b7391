"""A PEFT adapter directory: ``adapter_config.json`` and ``adapter_model.safetensors``.

This is what ``PeftModel.save_pretrained`` writes and what ``PeftModel.from_pretrained``,
SGLang's ``/load_lora_adapter {lora_name, lora_path}`` and the embedded server read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from arealite.utils.json_types import JsonObject

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def write_adapter_dir(path: Path, tensors: Iterable[tuple[str, torch.Tensor]], config: JsonObject,
                      dtype: torch.dtype | None = None) -> tuple[int, int]:
    """Write the adapter at ``path`` (created; ``dtype`` casts floats); returns (tensors, bytes)."""
    from safetensors.torch import save_file

    out: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        t = t.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=1))
    return len(out), sum(t.numel() * t.element_size() for t in out.values())


def read_adapter_dir(path: str | Path) -> tuple[JsonObject, dict[str, torch.Tensor]]:
    """``(config, tensors)`` of the adapter at ``path``; ``ValueError`` naming what is missing."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not cfg_file.is_file():
        raise ValueError(f"{path} has no {CONFIG_FILE}: not a PEFT adapter directory")
    if not weights.is_file():
        if (path / "adapter_model.bin").is_file():
            raise ValueError(f"{path}: adapter_model.bin is not supported; save the adapter as safetensors")
        raise ValueError(f"{path} has no {WEIGHTS_FILE}")
    config = json.loads(cfg_file.read_text())
    return config, load_file(str(weights))
