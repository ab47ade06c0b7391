"""`Critic`: scores batches with the value model and trains it on GAE returns."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from tensordict import TensorDictBase

from arealite.algo.actor import split_minibatches
from arealite.algo.loss import masked_mean
from arealite.algo.value import explained_variance, value_hook, value_loss
from arealite.api.contracts import HeadOutput, MicroBatch, TrainEngine

__all__ = ["Critic", "WithCritic", "critic_loss"]


def critic_loss(head: HeadOutput, mb: MicroBatch, value_clip: float | None) -> torch.Tensor:
    """The loss given to ``engine.train_batch``: token-mean clipped value loss of a packed
    micro-batch (``head.logits()`` the value model's ``[T, 1]`` values; ``mb["values"]`` the old values,
    ``mb["returns"]`` the targets, ``mb["loss_mask"]`` the trained tokens). Stats go to
    ``mb["_stats"]``."""
    for key in ("values", "returns", "loss_mask"):
        if key not in mb:
            raise KeyError(f"critic micro-batch lacks '{key}' (has {sorted(mb)}); compute values and "
                           "advantages (GAE) before Critic.update")
    mask = mb["loss_mask"].bool()
    token_loss, stats = value_loss(value_hook(head, mb), mb["values"], mb["returns"], mask, value_clip)
    loss = masked_mean(token_loss, mask)
    prev = mb.get("_stats")
    out = dict(prev) if isinstance(prev, dict) else {}
    out.update({k: float(v) for k, v in stats.items()})
    out["value_loss"] = float(loss.detach())
    mb["_stats"] = out
    return loss


def _n_loss_tokens(mb: MicroBatch) -> float:
    return float(mb["loss_mask"].bool().sum())


class Critic:
    """The value model of PPO with GAE, on a train engine whose forward yields ``[T, 1]`` values
    (`ValueEngine`). ``value_clip``: PPO2's clip of the value update (None = unclipped);
    ``n_minibatches``: optimizer steps per batch, like the actor's."""

    def __init__(self, engine: TrainEngine, value_clip: float | None = 0.2, n_minibatches: int = 1):
        if value_clip is not None and value_clip <= 0:
            raise ValueError(f"critic.value_clip must be > 0 (or null), got {value_clip}")
        self.engine = engine
        self.value_clip = value_clip
        self.n_minibatches = n_minibatches

    def compute_values(self, batch: TensorDictBase) -> torch.Tensor:
        """``V(s_t)`` for every token ``[B, L]``, aligned with ``logprobs`` (position 0 is 0)."""
        return self.engine.forward(batch, value_hook)

    def update(self, batch: TensorDictBase, train_mask: torch.Tensor | None = None) -> dict[str, float]:
        """``n_minibatches`` optimizer steps on the value loss; stats averaged over them, plus
        ``explained_variance`` of the old values against the returns.

        Needs ``values`` (from `compute_values`) and ``returns`` (from GAE). ``train_mask``
        replaces ``loss_mask`` (e.g. without excluded truncated samples).
        """
        missing = [k for k in ("values", "returns", "loss_mask") if k not in batch.keys()]
        if missing:
            raise KeyError(f"Critic.update: the batch lacks {missing} (run compute_values, then "
                           "PPOActor.compute_advantages with adv_estimator=gae)")
        mask = batch["loss_mask"].bool() if train_mask is None else train_mask.bool()
        if train_mask is not None:
            batch = batch.copy()
            batch["loss_mask"] = mask
        ev = explained_variance(batch["values"], batch["returns"], mask)
        loss_fn = functools.partial(critic_loss, value_clip=self.value_clip)
        steps = [self.engine.train_batch(mb, loss_fn, _n_loss_tokens)
                 for mb in split_minibatches(batch, self.n_minibatches)]
        out = {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}
        out["explained_variance"] = ev
        return out


class WithCritic:
    """The actor's engine with the critic's beside it, as the checkpointer sees one engine:
    ``save``/``load`` write and read both (the critic under ``<path>/critic``)."""

    def __init__(self, actor: TrainEngine, critic: TrainEngine):
        self.actor, self.critic = actor, critic

    def save(self, path: str | Path) -> None:
        self.actor.save(path)
        self.critic.save(Path(path) / "critic")

    def load(self, path: str | Path) -> None:
        self.actor.load(path)
        self.critic.load(Path(path) / "critic")

    def set_version(self, version: int) -> None:
        self.actor.set_version(version)
        self.critic.set_version(version)

    def get_version(self) -> int:
        return self.actor.get_version()
