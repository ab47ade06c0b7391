"""The gradient norm of a model whose parameters live on several meshes, with one reduction.

Under a composed layout the parameters are DTensors on different meshes: the layers' on
``fsdp x tp``, the embeddings and norms on ``fsdp`` alone, the experts on the expert mesh;
``clip_grad_norm_`` cannot stack them, and a DTensor norm over a 2-D mesh reduces one dimension
after the other. Here each rank sums the squares of its own shards, each divided by the number
of ranks holding a copy of that shard (the world size over the product of the mesh dimensions
the parameter is sharded over), and one all-reduce over the world adds them: the squared norm
of every parameter counted once.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["clip_grad_norm"]


def _copies(grad: torch.Tensor, world: int) -> int:
    """How many ranks hold the same local part of ``grad`` as this one."""
    placements = getattr(grad, "placements", None)
    if placements is None:
        return world  # a plain tensor: whole on every rank
    mesh = grad.device_mesh
    # Shard and its strided form (FSDP2's shard of a tensor-parallel shard) split the tensor.
    split = math.prod(mesh.size(i) for i, p in enumerate(placements) if not (p.is_replicate() or p.is_partial()))
    return world // split


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if hasattr(grad, "to_local") else grad


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """The gradient norm of ``params`` over every rank and mesh they live on; scales the gradients
    by ``max_norm / norm`` when that is below 1 (as ``torch.nn.utils.clip_grad_norm_`` does). A
    collective over the default group: every rank calls it."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        local = _local(g)
        if local.numel():
            squares += local.detach().double().pow(2).sum() / _copies(g, world)
    if world > 1:
        dist.all_reduce(squares)
    total = float(squares.sqrt())
    coef = max_norm / (total + 1e-6)
    if math.isfinite(total) and coef < 1.0:
        for g in grads:
            _local(g).mul_(coef)
    return total
