"""The cluster a plan is for: ``--gpus 8xH100`` (one node of eight), ``H200`` (one card),
``2x8xH100`` (nodes x cards per node).

The cards' figures (dense bf16 peak, HBM bandwidth, memory) are the simulator's table,
`arealite.sim.cost_model.GPUS`, so that a plan and a simulated run price a card alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from arealite.sim.cost_model import GPU_ALIASES, GPUS, GpuSpec

from .breakdown import GIB

__all__ = ["Cluster", "known_gpu_names", "parse_gpus"]

_FORM = re.compile(r"^(?:(\d+)x)?(?:(\d+)x)?([a-z0-9][a-z0-9_.-]*)$")


@dataclass(frozen=True)
class Cluster:
    """``n_gpus`` cards of one kind, ``gpus_per_node`` to a node."""

    n_gpus: int
    name: str
    """The table's name of the card (``h100``), whatever alias or case was typed."""
    spec: GpuSpec
    gpus_per_node: int

    @property
    def n_nodes(self) -> int:
        return self.n_gpus // self.gpus_per_node

    @property
    def memory_bytes(self) -> int:
        """One card's memory. The datasheets' "80 GB" of an H100 (141 of an H200) are read as
        GiB: the card shows about that many GiB to CUDA (the lent H100 ~78 GiB free), more
        than 80e9 bytes (74.5 GiB) would allow."""
        return int(self.spec.memory_gb * GIB)

    def describe(self) -> str:
        nodes = f"{self.n_nodes} node(s) x {self.gpus_per_node}" if self.n_nodes > 1 else f"{self.n_gpus}"
        return f"{nodes} x {self.name} ({self.spec.memory_gb:g} GiB, {self.spec.peak_tflops:g} TFLOP/s bf16)"


def known_gpu_names() -> list[str]:
    return sorted([*GPUS, *GPU_ALIASES])


def parse_gpus(text: str, *, memory_gib: float | None = None) -> Cluster:
    """``8xH100`` / ``H200`` / ``2x8xH100`` as a `Cluster` (names in any case, aliases such as
    ``H100-80GB`` or ``H800`` allowed). ``memory_gib`` replaces the card's memory
    (``--gpu-memory-gib``: a 40 GB A100, or what the card really has free). Raises ValueError
    naming the known cards for an unknown one, and the form for a malformed text."""
    m = _FORM.match(text.strip().lower().replace(" ", ""))
    if not m:
        raise ValueError(f"--gpus {text!r} is not COUNTxNAME, NAME or NODESxPER_NODExNAME (e.g. 8xH100, "
                         "H200, 2x8xH100)")
    first, second, name = m.groups()
    key = GPU_ALIASES.get(name, name)
    if key not in GPUS:
        raise ValueError(f"--gpus {text!r}: GPU {name!r} is not known; known: {', '.join(known_gpu_names())} "
                         "(or add its datasheet figures to arealite/sim/cost_model.py GPUS)")
    if second is not None:
        nodes, per_node = int(first), int(second)
    else:
        nodes, per_node = 1, int(first or 1)
    if nodes < 1 or per_node < 1:
        raise ValueError(f"--gpus {text!r}: the counts must be at least 1")
    spec = GPUS[key]
    if memory_gib is not None:
        if not memory_gib > 0:
            raise ValueError(f"--gpu-memory-gib {memory_gib} must be positive")
        spec = replace(spec, memory_gb=float(memory_gib))
    return Cluster(n_gpus=nodes * per_node, name=key, spec=spec, gpus_per_node=per_node)
