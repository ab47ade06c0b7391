"""A memory prediction: named parts in bytes, their total, and what the figure leaves out."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GIB", "MemoryBreakdown"]

GIB = 1 << 30


@dataclass
class MemoryBreakdown:
    """The predicted bytes of one process (a trainer rank or a server), part by part, in the
    order a reader should see them (e.g. ``parameters``, ``gradients``, ``optimizer``, ...)."""

    what: str
    """Whose memory: ``trainer rank (actor)``, ``server``."""
    parts: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    """What is assumed or left out (allocator fragmentation, NCCL buffers, ...)."""

    def add(self, name: str, nbytes: float) -> None:
        self.parts[name] = self.parts.get(name, 0) + int(nbytes)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def table(self, capacity: int | None = None) -> str:
        """The parts as a table in GiB, with the total (and its share of ``capacity``)."""
        width = max([len(n) for n in self.parts] + [5])
        lines = [f"{self.what}"]
        lines += [f"  {name:<{width}}  {nbytes / GIB:10.3f} GiB" for name, nbytes in self.parts.items()]
        total = f"  {'total':<{width}}  {self.total / GIB:10.3f} GiB"
        if capacity:
            total += f"  ({100 * self.total / capacity:.0f}% of {capacity / GIB:.0f} GiB)"
        lines.append(total)
        return "\n".join(lines)
