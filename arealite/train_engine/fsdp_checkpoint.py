"""Checkpoints and Hugging Face export of an FSDP2-sharded model.

A checkpoint is a DCP directory (model and optimizer, sharded: DCP reshards on
load when the world size changed) plus one small ``engine_rank<r>.pt`` per rank
with what DCP does not hold (version, step, LR schedule, RNG states). An export
is a plain HF directory: the full weights in one safetensors file, the config,
and the source directory's other files (tokenizer, chat template, ...).

Every function here is a collective: every rank calls it.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import torch
import torch.distributed as dist

from arealite.api.contracts import StateDict
from arealite.utils.checkpoint_names import checkpoint_tensors

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Files of a model directory that are weights; everything else (config,
# tokenizer, chat template, generation config) is copied by export_hf_dir.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def _model_and_optim_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> StateDict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def save_sharded(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, rank: int, extra: StateDict
) -> None:
    """Write model (and optimizer) with DCP, and ``extra`` to this rank's ``engine_rank<r>.pt``."""
    import torch.distributed.checkpoint as dcp

    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dcp.save(_model_and_optim_state(model, optimizer), checkpoint_id=str(path))
    torch.save(extra, path / f"engine_rank{rank}.pt")
    dist.barrier()


def load_sharded(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, rank: int
) -> StateDict:
    """Restore what ``save_sharded`` wrote into ``model`` (and ``optimizer``); return the ``extra`` it saved
    for this rank (rank 0's when the checkpoint had fewer ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{str(path)!r} is not an FSDPEngine checkpoint (no DCP .metadata file)")
    state = _model_and_optim_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    extra_file = path / f"engine_rank{rank}.pt"
    if not extra_file.is_file():
        extra_file = path / "engine_rank0.pt"
    # Tensors, numbers and tuples only (RNG states, LR schedule, version): no code can run.
    return torch.load(extra_file, weights_only=True, map_location="cpu")


class RngState(TypedDict):
    """This process's random number generators' states, as a checkpoint keeps them."""

    rng_torch: torch.Tensor
    rng_cuda: torch.Tensor | None  # None unless computing on CUDA
    rng_python: tuple[object, ...]  # `random.getstate()`


def rng_state(device: torch.device) -> RngState:
    """This process's RNG states (torch, CUDA when computing there, python)."""
    return {
        "rng_torch": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None,
        "rng_python": random.getstate(),
    }


def restore_rng(state: RngState, device: torch.device) -> None:
    """Set the RNG states ``rng_state`` returned."""
    torch.set_rng_state(state["rng_torch"])
    random.setstate(state["rng_python"])
    if state["rng_cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["rng_cuda"])


def tied_duplicate_names(hf_config: PretrainedConfig) -> set[str]:
    """State-dict names that alias another parameter and are absent from HF safetensors files."""
    if getattr(hf_config, "tie_word_embeddings", False):
        return {"lm_head.weight"}
    return set()


def export_hf_dir(path: Path, model: torch.nn.Module, rank: int, source_dir: Path,
                  hf_config: PretrainedConfig) -> None:
    """Gather the full weights and write, from rank 0, a HF directory at ``path``: safetensors,
    ``hf_config``, and the non-weight files of ``source_dir`` (tokenizer, templates)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        skip = tied_duplicate_names(hf_config)
        # The checkpoint's names and shapes (a mixture of experts: one tensor per expert, as
        # SGLang's loaders and the weight pushes name them).
        tensors = {n: t for k, v in full.items() if k not in skip for n, t in checkpoint_tensors(model, k, v)}
        write_hf_dir(path, tensors, source_dir, hf_config)
    dist.barrier()


def write_hf_dir(path: Path, tensors: dict[str, torch.Tensor], source_dir: Path,
                 hf_config: PretrainedConfig) -> None:
    """Write a HF directory at ``path``: ``tensors`` (full, HF names) as safetensors, ``hf_config``
    and the non-weight files of ``source_dir`` (tokenizer, templates). One process calls it."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    for f in source_dir.iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name != "config.json":
            shutil.copy2(f, path / f.name)
    hf_config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
