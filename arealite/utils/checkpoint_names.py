"""A Hugging Face model's tensors under the names and shapes its checkpoint files use.

Transformers 5 may keep a model's weights in memory in another layout than its checkpoint:
a mixture-of-experts block holds all experts' gate and up projections fused in one parameter
(``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``) where the
checkpoint, SGLang's loaders and the embedded server's update routes name each expert's
``mlp.experts.{e}.{gate,up,down}_proj.weight``. ``from_pretrained`` converts on load;
transformers' ``revert_weight_conversion`` converts back. Weight pushes speak the checkpoint's
names, so both ends go through here:

- the trainer sends `checkpoint_tensors` of each full weight;
- the embedded server receives into `checkpoint_views`: for a tensor stored fused, a view of its
  slice of the fused parameter under the checkpoint name, so an update writes straight through.

A dense model's names are the same in both layouts, and both functions leave it as it is.
"""

from __future__ import annotations

import torch

__all__ = ["checkpoint_tensors", "checkpoint_views"]


def _revert(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, tensors)


def checkpoint_tensors(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``model``'s tensor ``name`` (in-memory layout, whole) as the checkpoint's tensor(s)."""
    if _is_plain(model, name, tensor):
        return [(name, tensor)]
    return list(_revert(model, {name: tensor}).items())


def _is_plain(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Whether ``name`` is stored as the checkpoint stores it (checked on a meta tensor: no data)."""
    out = _revert(model, {name: torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")})
    return list(out) == [name] and tuple(out[name].shape) == tuple(tensor.shape)


def checkpoint_views(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (``model``'s tensors by in-memory name) with each tensor stored in another layout
    replaced by views of it under the checkpoint's names. Raises ``ValueError`` for a conversion
    that is not a plain slicing of the stored tensor (nothing to write through)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if _is_plain(model, name, t):
            out[name] = t
            continue
        # Convert the positions instead of the values: each checkpoint tensor then says which
        # elements of the stored one it is made of.
        index = _revert(model, {name: torch.arange(t.numel()).view(t.shape)})
        flat = t.view(-1)
        for ckpt_name, idx in index.items():
            start = int(idx.flatten()[0]) if idx.numel() else 0
            if not torch.equal(idx.flatten(), torch.arange(start, start + idx.numel())):
                raise ValueError(f"{ckpt_name!r} is not a contiguous slice of {name!r}: weight updates by "
                                 "checkpoint name cannot write through to this model's layout")
            out[ckpt_name] = flat[start:start + idx.numel()].view(idx.shape)
    return out
