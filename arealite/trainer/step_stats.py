"""The stats of one training step, assembled in one small object.

`StepStats` is filled in the order the step runs (rollout wait, training, weight
publish) and `finish()` merges it over trainer ranks (a collective) into the record
the stats logger writes. Every key a user may want to plot is here, with a prefix
that says where it comes from: ``rollout/``, ``train/``, ``weight_sync/``, ``time/``,
``perf/``, ``controller/``, ``client/`` and the per-prompt accounting fields.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch.distributed as dist

from arealite.rollout.staleness import trajectory_staleness
from arealite.utils import accounting
from arealite.utils.json_types import JsonObject, JsonValue

if TYPE_CHECKING:
    from tensordict import TensorDictBase

#: Client counters that add up over ranks (each rank has its own client).
CLIENT_COUNTS = ("requests", "retries", "timeouts", "connection_errors", "http_5xx", "malformed",
                 "evicted", "interrupted_requests", "marked_unhealthy", "recovered")


class StepStats:
    """Collects one step's figures; `lap(name)` records ``time/<name>_s`` since the last lap."""

    def __init__(self, version: int):
        self.version = version
        self.values: JsonObject = {}
        self._t0 = self._last = time.perf_counter()

    def lap(self, name: str) -> float:
        """Record the time since the previous lap as ``time/<name>_s``; returns it."""
        now = time.perf_counter()
        dt = now - self._last
        self.values[f"time/{name}_s"] = dt
        self._last = now
        return dt

    def add(self, prefix: str, values: Mapping[str, JsonValue]) -> None:
        """Add numeric `values` under ``<prefix>/`` (non-numbers are skipped)."""
        for k, v in values.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.values[f"{prefix}/{k}"] = float(v)

    def add_batch(self, batch: TensorDictBase) -> None:
        """Reward, length and staleness figures of this rank's training batch."""
        self.values.update(batch_stats(batch, self.version))

    def add_train(self, minibatch_stats: Sequence[Mapping[str, float]]) -> None:
        """The PPO update's stats, averaged over mini-batches, under ``train/``."""
        n = max(len(minibatch_stats), 1)
        for mb in minibatch_stats:
            for k, v in mb.items():
                key = f"train/{k}"
                self.values[key] = self.values.get(key, 0.0) + v / n

    def add_accounting(self, items: Sequence[JsonObject], dropped: Sequence[JsonObject]) -> None:
        """Which prompts this step trained on and which were rejected or failed."""
        self.values.update(accounting.step_fields(items, dropped))

    def add_rollout_side(self, controller_stats: Mapping[str, JsonValue],
                         client_stats: Mapping[str, JsonValue]) -> None:
        """The controller's queue and staleness counters and the client's failure counters."""
        self.add("controller", controller_stats)
        self.add("client", {k: client_stats[k] for k in (*CLIENT_COUNTS, "n_healthy") if k in client_stats})

    def finish(self) -> JsonObject:
        """Merge over ranks (collective) and add the derived figures; returns the record."""
        v = self.values
        v["time/step_s"] = time.perf_counter() - self._t0
        train_s = v.get("time/train_s")
        if train_s and "rollout/n_tokens" in v:
            v["perf/train_tokens_per_s"] = v["rollout/n_tokens"] / max(train_s, 1e-9)
        out = reduce_stats(v, sum_keys=[f"client/{k}" for k in CLIENT_COUNTS])
        if accounting.EPOCHS in out:
            out["rollout/epoch"] = min(out[accounting.EPOCHS], default=-1)
        return out


def batch_stats(batch: TensorDictBase, version: int) -> dict[str, float]:
    """Reward, length and staleness figures of one training batch (this rank's rows)."""
    rewards = batch["rewards"].float()
    lm = batch["loss_mask"].bool()
    resp_len = lm.sum(-1).float()
    staleness = trajectory_staleness(batch["versions"], lm, version)
    out = {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        "rollout/accuracy": (rewards > 0.5).float().mean().item(),
        "rollout/response_len_mean": resp_len.mean().item(),
        "rollout/response_len_max": resp_len.max().item(),
        "rollout/n_trajectories": float(rewards.numel()),
        "rollout/n_tokens": float(batch["attention_mask"].sum().item()),
        "rollout/staleness_mean": staleness.float().mean().item(),
        "rollout/staleness_max": staleness.max().item(),
    }
    for s, n in sorted(collections.Counter(staleness.tolist()).items()):
        out[f"rollout/staleness_hist/{int(s)}"] = float(n)
    return out


def reduce_stats(stats: Mapping[str, JsonValue], sum_keys: Sequence[str] = ()) -> JsonObject:
    """Merge every rank's stats (a collective): ``*_max`` keys take the max, ``sum_keys``,
    counts and histogram buckets the sum, lists are concatenated in rank order, the rest
    is averaged. Ranks may hold different keys (histogram buckets differ)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(stats)
    gathered: list[JsonObject] = [{}] * dist.get_world_size()  # filled by the collective
    dist.all_gather_object(gathered, dict(stats))
    keys = sorted({k for g in gathered for k in g})
    out: JsonObject = {}
    for k in keys:
        lists = [g[k] for g in gathered if isinstance(g.get(k), list)]
        if lists:  # per-rank lists (e.g. prompt ids): concatenated in rank order
            out[k] = [x for lst in lists for x in lst]
            continue
        vals = [float(g[k]) for g in gathered if k in g and isinstance(g[k], (int, float))]
        if not vals:
            continue
        if k.endswith("_max"):
            out[k] = max(vals)
        elif k in sum_keys or "/staleness_hist/" in k or k.startswith("rollout/n_"):
            out[k] = sum(vals)
        else:
            out[k] = sum(vals) / len(vals)
    return out
