"""Serving weights straight out of the trainer's shared-memory files (no copy).

With ``alias: true`` on ``/update_weights_from_shm``, the server points every parameter at
its slot of the mapped file instead of copying the slot into its own storage: an update
then costs the trainer's one write into the file and a pointer swap here. The trainer
keeps two files and writes the one no server serves from (``arealite.weight_sync.shm``),
so a file never changes under a running forward.

The mapping is read-only: nothing may write into an aliased parameter. Every update that
copies (from disk, a process group, or shared memory without ``alias``) first gives the
model its own storage again (`own_weights`).
"""

from __future__ import annotations

import torch

from .weights import ShmWeightFile, model_state

__all__ = ["AliasedFiles", "alias_problem", "alias_weights", "aliasable", "own_weights"]


def alias_problem(device: torch.device) -> str | None:
    """Why this server cannot serve weights in place, or None (checked before anything changes)."""
    if device.type != "cpu":
        return f"alias needs a CPU server (this one runs on {device}); send the update without alias"
    return None


def aliasable(model: torch.nn.Module, names: list[str]) -> bool:
    """Whether every named tensor is a parameter of its own, which a file slot can stand in for.
    A mixture-of-experts model's per-expert tensors are slices of fused parameters (the
    checkpoint's names, `arealite.utils.checkpoint_names`): they are copied instead."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return all(n in params for n in names)


def alias_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], shm: ShmWeightFile,
                  names: list[str], dtypes: list[torch.dtype], shapes: list[tuple[int, ...]],
                  offsets: list[int]) -> None:
    """Point each named parameter at its slot of `shm` (checked by `check_shm_layout` and
    `alias_problem`, `aliasable`); `state` is refreshed in place to the new storage."""
    with torch.no_grad():
        for name, dt, shape, off in zip(names, dtypes, shapes, offsets):
            model.get_parameter(name).data = shm.tensor(off, dt, shape)
    state.clear()
    state.update(model_state(model))


def own_weights(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Give every parameter that lives in a mapped file its own storage again."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    state.clear()
    state.update(model_state(model))


class AliasedFiles:
    """The mapped shared-memory files: at most the one the model serves from and the one the
    trainer is filling (a third, newer file releases the oldest that nothing serves from)."""

    def __init__(self):
        self.files: dict[tuple, ShmWeightFile] = {}
        self.serving: tuple | None = None  # key of the file the parameters point into

    def get(self, key: tuple, path: str) -> ShmWeightFile:
        if key in self.files:
            return self.files[key]
        for k in [k for k in self.files if k != self.serving]:
            self.files.pop(k).close()  # another file now: release the old one's memory
        self.files[key] = ShmWeightFile(path)
        return self.files[key]

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()
        self.serving = None
