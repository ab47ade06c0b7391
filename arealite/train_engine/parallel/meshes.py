"""The device meshes and groups of a `ParallelLayout`: one world mesh, and the views each part of the engine takes.

Ranks are numbered over the grid ``(dp_replicate, dp_shard, sp, tp)``, outermost first
(`rank_grid`). The world mesh is one ``init_device_mesh`` over ``(dp_replicate, dp_shard_sp,
tp)``, the data and sequence ranks of a replica as one dimension, since that is what FSDP2
shards over; the engine takes these views of it:

- ``fsdp``: ``dp_shard_sp``, or with hybrid sharding the 2-D ``(dp_replicate, dp_shard_sp)``
  (FSDP2 replicates over the first dimension and shards over the second);
- ``tp``: the tensor-parallel ranks (DTensor's mesh for the split projections; FSDP2 composes
  its shards with them because both are views of one mesh);

and two process groups over blocks of the grid that split the ``dp_shard_sp`` dimension:

- ``sp``: the sequence-parallel group (Ulysses' all-to-alls, the gather of the log-probs);
- ``group``: the ``sp x tp`` ranks that compute the same micro-batches (the rows they are
  handed are gathered over it).

Expert parallelism draws ``ep`` consecutive ranks of the ``dp_shard x sp`` ranks of each
replica and tensor-parallel position; its mesh (``ep_replicas x ep``) is a second mesh over the
same ranks, since its groups stride the world mesh's dimensions. The expert weights live on it
alone (FSDP2 leaves them out), so it need not share the world mesh's root.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from arealite.train_engine.parallel.layout import ParallelLayout

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ParallelMeshes", "build_meshes", "expert_mesh_ranks"]

#: The world mesh's dimensions, outermost first.
WORLD_DIMS = ("dp_replicate", "dp_shard_sp", "tp")


@dataclass
class ParallelMeshes:
    """The meshes and groups of a layout on this rank (see the module's docstring)."""

    world: DeviceMesh
    fsdp: DeviceMesh
    tp: DeviceMesh | None = None
    """None when ``tp == 1``."""
    sp: dist.ProcessGroup | None = None
    """None when ``sp == 1``."""
    group: dist.ProcessGroup | None = None
    """The model-parallel group (``sp x tp`` ranks; None when both are 1)."""
    ep: DeviceMesh | None = None
    """The ranks that split one copy of the experts (None when ``ep == 1``)."""
    ep_replicas: dist.ProcessGroup | None = None
    """The ranks holding the same experts as this one (``ep > 1``)."""


def rank_grid(layout: ParallelLayout) -> torch.Tensor:
    """``[dp_replicate, dp_shard, sp, tp]``: the rank at each position of the layout."""
    return torch.arange(layout.world).reshape(layout.dp_replicate, layout.dp_shard, layout.sp, layout.tp)


def expert_mesh_ranks(layout: ParallelLayout) -> torch.Tensor:
    """``[world / ep, ep]``: row ``i`` the ranks of expert group ``i`` (consecutive ranks of the
    flattened ``dp_shard x sp`` ranks of one replica and one tensor-parallel position)."""
    ranks = rank_grid(layout).reshape(layout.dp_replicate, -1, layout.ep, layout.tp)
    return ranks.permute(0, 1, 3, 2).reshape(-1, layout.ep)


def _subgroup(blocks: torch.Tensor) -> dist.ProcessGroup:
    """This rank's group among ``blocks`` (``[n, size]``: each row a group's ranks; a collective:
    every rank creates every group)."""
    import torch.distributed as dist

    group, _ = dist.new_subgroups_by_enumeration(blocks.tolist())
    return group


def build_meshes(layout: ParallelLayout, device_type: str) -> ParallelMeshes:
    """The meshes of ``layout`` (a collective: every rank calls it)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    shape = (layout.dp_replicate, layout.dp_shard * layout.sp, layout.tp)
    world = init_device_mesh(device_type, shape, mesh_dim_names=WORLD_DIMS)
    fsdp = world["dp_replicate", "dp_shard_sp"] if layout.dp_replicate > 1 else world["dp_shard_sp"]
    meshes = ParallelMeshes(world=world, fsdp=fsdp)
    grid = rank_grid(layout)
    if layout.tp > 1:
        meshes.tp = world["tp"]
    if layout.sp > 1:
        meshes.sp = _subgroup(grid.permute(0, 1, 3, 2).reshape(-1, layout.sp))
    if layout.group_size > 1:
        meshes.group = _subgroup(grid.reshape(-1, layout.group_size))
    if layout.ep > 1:
        experts = DeviceMesh(device_type, expert_mesh_ranks(layout), mesh_dim_names=("ep_replicas", "ep"))
        meshes.ep, meshes.ep_replicas = experts["ep"], experts["ep_replicas"].get_group()
    return meshes
