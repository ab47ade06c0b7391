"""The plan as a picture: each process's memory as a stacked bar against the card's line."""

from __future__ import annotations

from pathlib import Path

from arealite.plan.breakdown import GIB
from arealite.plan.run_plan import RunPlan

__all__ = ["draw_plan"]


def draw_plan(plan: RunPlan, path: str | Path) -> Path:
    """Write ``plan``'s memory picture to ``path`` (PNG): one bar per kind of process, its parts
    stacked in GiB, and the card's memory as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(f"trainer rank\n({s})", b) for s, b in plan.trainers.items()]
    if plan.server is not None:
        bars.append(("server", plan.server.breakdown))
    names = list(dict.fromkeys(n for _, b in bars for n in b.parts))
    colours = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(bars), 4.8))
    labelled: set[str] = set()
    for x, (_, breakdown) in enumerate(bars):
        bottom = 0.0
        for i, name in enumerate(names):
            height = breakdown.parts.get(name, 0) / GIB
            if height:
                ax.bar(x, height, bottom=bottom, color=colours(i % 20), width=0.6,
                       label=None if name in labelled else name)
                labelled.add(name)
                bottom += height
    ax.axhline(plan.capacity / GIB, color="black", linestyle="--", linewidth=1)
    ax.text(len(bars) - 0.5, plan.capacity / GIB, f" {plan.cluster.name}: {plan.capacity / GIB:.0f} GiB",
            va="bottom", ha="right", fontsize=8)
    ax.set_xticks(range(len(bars)), [label for label, _ in bars])
    ax.set_ylabel("GiB")
    ax.set_title(f"predicted memory on {plan.cluster.n_gpus} x {plan.cluster.name}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
