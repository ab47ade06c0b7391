"""Stats logging: JSONL always, TensorBoard and W&B when configured, a reward curve at the end.

Only trainer rank 0 writes. Every value a user may want goes through ``log``:
one JSON object per training step in ``<run_dir>/stats.jsonl``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Mapping

from arealite.config.schema import StatsConfig
from arealite.utils.json_types import JsonObject

logger = logging.getLogger("arealite.stats")


def _to_float(v: object) -> object:
    """Plain JSON-able numbers from tensors, numpy scalars and the like."""
    if hasattr(v, "item") and callable(v.item):
        try:
            return v.item()
        except (ValueError, RuntimeError):  # a tensor of several elements
            return v.tolist()
    if isinstance(v, Mapping):
        return {str(k): _to_float(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_to_float(x) for x in v]
    return v


def flatten(d: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    """``{"a": {"b": 1}}`` -> ``{"a/b": 1}``."""
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def _masked(full_config: Mapping[str, object]) -> JsonObject:
    """A copy of the config with secret values (server.api_key) replaced by ``***``: W&B uploads it."""
    from arealite.config.loader import SECRET_FIELDS

    out = json.loads(json.dumps(dict(full_config), default=str))
    for dotted in SECRET_FIELDS:
        *parents, leaf = dotted.split(".")
        node = out
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(leaf) is not None:
            node[leaf] = "***"
    return out


class StatsLogger:
    """Writes one record per step to JSONL (and TensorBoard / W&B when enabled)."""

    def __init__(self, run_dir: str | Path, config: StatsConfig | None = None,
                 rank: int = 0, run_name: str = "arealite", full_config: Mapping | None = None):
        self.config = config or StatsConfig()
        self.rank = rank
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "stats.jsonl"
        self._file = None
        self._tb = None
        self._wandb = None
        if rank != 0:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torn = False
        if self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, "rb") as f:
                f.seek(-1, 2)
                torn = f.read(1) != b"\n"
        self._file = open(self.path, "a", buffering=1)
        if torn:  # a killed run left half a line: end it, so this run's first record stays intact
            self._file.write("\n")
        if self.config.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # pragma: no cover - depends on the extra
                raise RuntimeError(
                    "stats.tensorboard=true needs the tensorboard package: pip install 'arealite[tensorboard]'"
                ) from e
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        if self.config.wandb.mode != "disabled":
            try:
                import wandb
            except ImportError as e:  # pragma: no cover - depends on the extra
                raise RuntimeError(
                    "stats.wandb.mode is set but wandb is not installed: pip install 'arealite[wandb]'"
                ) from e
            self._wandb = wandb.init(
                project=self.config.wandb.project, entity=self.config.wandb.entity,
                mode=self.config.wandb.mode, name=run_name, dir=str(self.run_dir),
                config=_masked(full_config or {}), resume="allow",
            )

    def log(self, step: int, stats: Mapping[str, object]) -> dict[str, object]:
        """Record the stats of one step; returns the flat record that was written."""
        record = {"step": int(step), "time": time.time(), **flatten(_to_float(dict(stats)))}
        if self.rank != 0:
            return record
        self._file.write(json.dumps(record, default=str) + "\n")
        scalars = {k: v for k, v in record.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "time")}
        if self._tb is not None:
            for k, v in scalars.items():
                if math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_stats(path: str | Path) -> list[JsonObject]:
    """All records of a stats.jsonl file (a torn last line from a crash is skipped)."""
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def plot_reward_curve(stats_path: str | Path, out_png: str | Path,
                      keys: tuple[str, ...] = ("rollout/reward_mean", "eval/accuracy"),
                      title: str = "arealite") -> Path | None:
    """Plot the training reward (and held-out accuracy where logged) against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_stats(stats_path)
    if not records:
        return None
    # A step may have several records (training, then evaluation), and a resumed
    # run appends: merge them, later values winning.
    by_step: dict[int, dict] = {}
    for r in records:
        by_step.setdefault(r["step"], {}).update(r)
    steps = sorted(by_step)
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in keys:
        pts = [(s, by_step[s][key]) for s in steps if isinstance(by_step[s].get(key), (int, float))]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if key.startswith("eval") else None,
                    markersize=4, label=key)
    ax.set_xlabel("training step (policy version)")
    ax.set_ylabel("reward / accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
