"""The PEFT-wrapped causal LM and its adapter in PEFT's file format.

`lora_causal_lm` builds what `FSDPEngine` shards: the HF causal LM (as `causal_lm` makes it)
wrapped by ``peft.get_peft_model``, with every base weight frozen and LoRA on
``target_modules``. The adapter's tensors go out under PEFT's saved names
(``base_model.model.<module>.lora_A.weight``), which SGLang's and the embedded server's
``/load_lora_adapter`` read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from arealite.config.schema import LoraConfig
from arealite.lora.modules import check_target_modules
from arealite.train_engine.fsdp_model import causal_lm
from arealite.utils.json_types import JsonObject

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: PEFT's adapter name for the one adapter the engine trains.
ADAPTER = "default"
#: Seed of the adapters' initialisation.
INIT_SEED = 0


def lora_causal_lm(path: Path, hf_config: PretrainedConfig, lora: LoraConfig,
                   attn_implementation: str | None = None) -> torch.nn.Module:
    """The causal LM at ``path`` with LoRA adapters (B initialised to 0: it starts as the base)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    model = causal_lm(path, hf_config, attn_implementation)
    check_target_modules(model, lora.target_modules)
    peft_cfg = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                              target_modules=list(lora.target_modules), bias="none")
    # A is random (B is 0): the same seed on every rank and in every run, so that the shards of
    # every rank belong to one matrix and a run with 1 or N ranks starts from the same adapter.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(INIT_SEED)
        return get_peft_model(model, peft_cfg)


def is_lora_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def peft_key(param_name: str) -> str:
    """A LoRA parameter's name in a saved PEFT adapter (the adapter name dropped)."""
    return param_name.replace(f".{ADAPTER}.", ".")


def hf_name(param_name: str) -> str:
    """A base parameter's name in the HF checkpoint (PEFT's prefix and ``base_layer`` dropped)."""
    return param_name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def full(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The whole tensor of a (possibly sharded, possibly offloaded) parameter; a collective."""
    t = t.detach()
    if t.device != device:
        t = t.to(device)
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def adapter_tensors(model: torch.nn.Module, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter's tensors under PEFT's saved names (a collective: every rank calls it).

    They are small and many (two per adapted layer), so they are gathered together, in one
    collective (`full_together`), not one per tensor."""
    named = [(peft_key(name), p) for name, p in model.named_parameters() if is_lora_param(name)]
    yield from zip((n for n, _ in named), full_together([p for _, p in named], device))


def full_together(params: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """`full` of every parameter with one all-gather when they are all sharded on dim 0 of one
    mesh in one dtype, as FSDP2 shards them (else one `full` each). A collective.

    Rank r of a world of W holds rows ``[r*c, (r+1)*c)`` of a tensor with n rows, c =
    ceil(n / W) (``torch.chunk``'s split, FSDP2's and DTensor's ``Shard(0)``): each rank pads
    its pieces to c rows and sends them as one flat buffer; every piece is then cut out of
    every rank's buffer and the rows are joined."""
    dts = [p.detach() for p in params]
    if not dts or not all(hasattr(t, "full_tensor") for t in dts):
        return [full(t, device) for t in params]
    from torch.distributed.tensor import Shard

    mesh, dtype = dts[0].device_mesh, dts[0].dtype
    if (mesh.ndim != 1 or any(t.device_mesh != mesh or t.dtype != dtype or tuple(t.placements) != (Shard(0),)
                              for t in dts)):
        return [full(t, device) for t in params]
    world = mesh.size()
    locals_ = [t.to_local().to(device) for t in dts]
    if world == 1:
        return locals_
    rows = [math.ceil(t.shape[0] / world) for t in dts]
    row_numel = [math.prod(t.shape[1:]) for t in dts]
    sizes = [r * k for r, k in zip(rows, row_numel)]
    buf = torch.zeros(sum(sizes), dtype=dtype, device=device)
    offsets = [0]
    for size, local in zip(sizes, locals_):
        buf[offsets[-1]:offsets[-1] + local.numel()] = local.reshape(-1)
        offsets.append(offsets[-1] + size)
    gathered = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(gathered, buf, group=mesh.get_group())
    out = []
    for t, start, size, k in zip(dts, offsets, sizes, row_numel):
        flat = torch.cat([g[start:start + size] for g in gathered])[:t.shape[0] * k]
        out.append(flat.view(t.shape))
    return out


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules carrying an adapter, by their path in ``model``."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def merged_weights(model: torch.nn.Module, device: torch.device, skip: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every base weight in HF names with its adapter merged in (``W + B @ A * scaling``).

    A collective on a sharded model: every rank iterates it to the end. ``skip``: HF names
    left out (tied duplicates)."""
    layers = lora_layers(model)
    for name, p in model.named_parameters():
        if is_lora_param(name) or hf_name(name) in skip:
            continue
        t = full(p, device)
        owner = name.rsplit(".base_layer.", 1)[0] if name.endswith(".base_layer.weight") else None
        if owner in layers:
            m = layers[owner]
            a = full(m.lora_A[ADAPTER].weight, device)
            b = full(m.lora_B[ADAPTER].weight, device)
            t = t + (b.float() @ a.float()).to(t.dtype) * m.scaling[ADAPTER]
        yield hf_name(name), t


def adapter_config(model: torch.nn.Module, base_model_path: str) -> JsonObject:
    """``adapter_config.json`` of the trained adapter (JSON-ready)."""
    cfg = model.peft_config[ADAPTER].to_dict()
    cfg["base_model_name_or_path"] = base_model_path
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}
