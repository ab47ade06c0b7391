"""PPOActor: PPO/GRPO on any train engine that speaks the packed micro-batch contract.

The training script calls, per step::

    if actor.needs_prox_logp:                         # decoupled PPO over several mini-batches
        batch["prox_logp"] = actor.compute_logp(batch)
    actor.compute_advantages(batch)                   # adds batch["advantages"] [B, L]
    stats = actor.ppo_update(batch)                   # n_minibatches optimizer steps

With one mini-batch the proximal policy is the training forward itself (the
weights before the update), so decoupled PPO needs no separate forward pass.

The engine (a ``TrainEngine``, arealite/api/contracts.py: ``FSDPEngine`` or any
object with ``forward(batch, post_hook)`` and ``train_batch(batch, loss_fn,
loss_weight_fn)``, see docs/internals.md) knows nothing of PPO; this class builds
the hook, the loss and its weight. The advantage estimator and the policy loss
are the ones the config names (``algorithm.adv_estimator``, ``algorithm.policy_loss``).
"""

from __future__ import annotations

import functools

import torch
from tensordict import TensorDictBase

from arealite.algo.advantage import (
    broadcast_to_tokens,
    group_advantages,
    resolve_advantage_estimator,
    stepwise_advantages,
    transform_rewards,
)
from arealite.algo.loss import (
    bind_policy_loss,
    kl_penalty,
    loss_weight,
    masked_mean,
    ppo_actor_loss,
    resolve_policy_loss,
)
from arealite.algo.overlong import exclude_rows, soft_overlong_penalty, truncated_rows
from arealite.algo.returns import discounted_returns, gae, global_whiten, terminal_rewards
from arealite.api.contracts import HeadOutput, MicroBatch, TrainEngine
from arealite.config.algo_checks import raise_algorithm_problems
from arealite.config.schema import AlgorithmConfig

__all__ = ["PPOActor", "split_minibatches", "logprob_hook"]

def logprob_hook(head: HeadOutput, mb: MicroBatch, temperature: float) -> torch.Tensor:
    """``engine.forward`` post-hook: the log-prob of each ``mb["labels"]`` token, ``[T]``."""
    return head.logprobs(mb["labels"], temperature)


def _weight_fn(mb: MicroBatch, mode: str) -> float:
    return loss_weight(mb["loss_mask"], mode, mb.get("cu_seqlens"))


def split_minibatches(batch: TensorDictBase, n: int) -> list[TensorDictBase]:
    """Split ``batch`` into ``n`` mini-batches, keeping each ``group_id`` group whole when possible.

    Groups (or rows, when there is no ``group_id`` or fewer groups than ``n``)
    are dealt out in order into ``n`` nearly equal chunks.
    """
    B = batch.batch_size[0]
    if n < 1:
        raise ValueError(f"n_minibatches must be >= 1, got {n}")
    if n > B:
        raise ValueError(f"algorithm.n_minibatches={n} is larger than the batch ({B} trajectories); lower it")
    if n == 1:
        return [batch]
    if "group_id" in batch.keys():
        _, inv = torch.unique(batch["group_id"], return_inverse=True)
        n_groups = int(inv.max()) + 1
        if n_groups >= n:
            chunk_of_row = (inv * n) // n_groups
            return [batch[(chunk_of_row == k).nonzero().squeeze(-1)] for k in range(n)]
    chunk_of_row = (torch.arange(B) * n) // B
    return [batch[(chunk_of_row == k).nonzero().squeeze(-1)] for k in range(n)]


class PPOActor:
    """Ties log-prob recomputation, advantages and the PPO loss to a train engine.

    ``temperature`` must be the rollout sampling temperature (log-probs are
    recomputed as ``log_softmax(logits / T)``, like the server's).
    ``max_new_tokens`` is the default length normaliser of ``seq-mean-token-sum``.
    ``ref_engine`` (a frozen engine) scores the reference log-probs of the KL term.
    """

    def __init__(
        self,
        config: AlgorithmConfig,
        engine: TrainEngine,
        temperature: float,
        ref_engine: TrainEngine | None = None,
        max_new_tokens: int | None = None,
    ):
        if not (isinstance(temperature, (int, float)) and temperature > 0):
            raise ValueError(
                f"PPOActor temperature must be > 0 (the rollout sampling temperature), got {temperature!r}"
            )
        if config.c_clip is not None and config.c_clip <= 1:
            raise ValueError(f"algorithm.c_clip must be > 1 (or null to disable dual clip), got {config.c_clip}")
        self.agg_constant: float | None = config.loss_agg_constant or (
            float(max_new_tokens) if max_new_tokens else None
        )
        if config.loss_agg_mode == "seq-mean-token-sum" and not self.agg_constant:
            raise ValueError(
                "algorithm.loss_agg_mode=seq-mean-token-sum needs a length normaliser: "
                "set algorithm.loss_agg_constant or pass max_new_tokens to PPOActor"
            )
        raise_algorithm_problems(config)
        self.config = config
        self.max_new_tokens = max_new_tokens
        # Resolved once, so that a bad name fails here rather than at the first step.
        self.adv_estimator = None if config.adv_estimator == "gae" else resolve_advantage_estimator(
            config.adv_estimator)
        self.policy_loss = resolve_policy_loss(config.policy_loss)
        self.engine = engine
        self.ref_engine = ref_engine
        self.temperature = float(temperature)
        self.adv_stats: dict[str, float] = {}

    # ------------------------------------------------------------------ log-probs
    @property
    def needs_prox_logp(self) -> bool:
        """Whether the decoupled loss needs ``batch["prox_logp"]`` computed before ``ppo_update``.

        Only with several mini-batches: the later ones run on updated weights, so
        the proximal log-probs must be taken first. With one, the loss uses the
        training forward's own (detached) log-probs, which are the same numbers.
        """
        return self.config.use_decoupled_loss and self.config.n_minibatches > 1

    def compute_logp(self, batch: TensorDictBase, engine: TrainEngine | None = None) -> torch.Tensor:
        """Log-probs ``[B, L]`` of the batch's tokens under the engine's current weights.

        Same layout as the trajectory's ``logprobs`` (``out[b, j]`` scores
        ``input_ids[b, j]``; position 0 is 0). ``engine`` defaults to the actor's.
        """
        hook = functools.partial(logprob_hook, temperature=self.temperature)
        return (engine if engine is not None else self.engine).forward(batch, hook)

    # ----------------------------------------------------------------- advantages
    def compute_advantages(self, batch: TensorDictBase) -> TensorDictBase:
        """Add ``batch["advantages"] [B, L]`` (0 outside the trained tokens); returns the batch.

        rewards (+ DAPO overlong penalty) -> ``transform_rewards`` -> either
        ``algorithm.adv_estimator`` per group (step-wise when the batch has ``traj_id`` and
        ``step_id``), put on the last policy token, or with ``gae`` the critic's
        ``batch["values"]`` (then ``batch["returns"]`` is added too) -> with
        ``kl_in_reward`` a ``-kl_coef * KL`` reward on every token -> reward-to-go
        (``gamma``) -> optional whitening over the global batch. Samples left out by
        ``overlong.exclude_truncated`` get advantage 0. Stats go to ``self.adv_stats``.
        """
        cfg = self.config
        for key in ("rewards", "loss_mask"):
            if key not in batch.keys():
                raise KeyError(f"compute_advantages needs '{key}' in the batch (has {sorted(batch.keys())})")
        B = batch.batch_size[0]
        rewards, shaping = self._shaped_rewards(batch)
        mask = self.train_mask(batch)
        kl_reward = self._kl_reward(batch, mask)
        if cfg.adv_estimator == "gae":
            if "values" not in batch.keys():
                raise KeyError("algorithm.adv_estimator=gae needs the critic's 'values' [B, L] in the batch: "
                               "run Critic.compute_values first")
            adv, batch["returns"] = gae(terminal_rewards(rewards, mask) + kl_reward, batch["values"], mask,
                                        cfg.gamma, cfg.gae_lambda)
            seq_adv = adv.sum(-1)
        else:
            seq_adv = self._sequence_advantages(batch, rewards)
            if cfg.kl_in_reward or cfg.gamma != 1.0:
                adv = discounted_returns(terminal_rewards(seq_adv, mask) + kl_reward, mask, cfg.gamma)
            else:
                adv = broadcast_to_tokens(seq_adv, mask)
        if cfg.adv_norm == "batch":
            adv = global_whiten(adv, mask)
        batch["advantages"] = adv

        vals = adv[mask]
        empty = vals.numel() == 0
        self.adv_stats = {
            "reward_mean": float(batch["rewards"].float().mean()) if B else 0.0,
            "adv_mean": 0.0 if empty else float(vals.mean()),
            "adv_std": 0.0 if vals.numel() < 2 else float(vals.std()),
            "adv_max": 0.0 if empty else float(vals.max()),
            "adv_min": 0.0 if empty else float(vals.min()),
            "adv_zero_seq_frac": float((seq_adv == 0).float().mean()) if B else 0.0,
            **shaping,
        }
        return batch

    def _sequence_advantages(self, batch: TensorDictBase, rewards: torch.Tensor) -> torch.Tensor:
        """``algorithm.adv_estimator`` on the (shaped) rewards: one advantage per row ``[B]``."""
        cfg = self.config
        if "group_id" in batch.keys():
            group_id = batch["group_id"]
        elif cfg.adv_estimator in ("none", "reinforce_pp"):
            group_id = torch.arange(batch.batch_size[0])
        else:
            raise KeyError(
                f"algorithm.adv_estimator={cfg.adv_estimator} needs 'group_id' [B] in the batch "
                "(samples of one prompt share it)"
            )
        if "traj_id" in batch.keys():
            if "step_id" not in batch.keys():
                raise KeyError("a batch with 'traj_id' (multi-step runs) also needs 'step_id' [B]")
            return stepwise_advantages(rewards, group_id, batch["traj_id"], batch["step_id"],
                                       self.adv_estimator, cfg.stepwise_divide_by_steps)
        return group_advantages(rewards, group_id, self.adv_estimator)

    def _truncated(self, batch: TensorDictBase) -> torch.Tensor:
        """Which rows were cut at the length limit (the workflow's ``truncated`` flag when present)."""
        limit = self.max_new_tokens or int(batch["loss_mask"].shape[1])
        flag = batch["truncated"] if "truncated" in batch.keys() else None
        return truncated_rows(batch["loss_mask"], limit, flag)

    def train_mask(self, batch: TensorDictBase) -> torch.Tensor:
        """The tokens the update trains on: ``loss_mask`` less the truncated samples when
        ``algorithm.overlong.exclude_truncated``."""
        mask = batch["loss_mask"].bool()
        if self.config.overlong.exclude_truncated:
            mask = exclude_rows(mask, self._truncated(batch))
        return mask

    def _shaped_rewards(self, batch: TensorDictBase) -> tuple[torch.Tensor, dict[str, float]]:
        """The rewards after DAPO's soft overlong penalty and ``transform_rewards``, and shaping stats."""
        cfg, ov = self.config, self.config.overlong
        raw = batch["rewards"].float()
        stats: dict[str, float] = {}
        if ov.buffer_len is not None or ov.exclude_truncated:
            stats["overlong_truncated_frac"] = float(self._truncated(batch).float().mean()) if raw.numel() else 0.0
        if ov.buffer_len is not None:
            if not self.max_new_tokens:
                raise ValueError("algorithm.overlong.buffer_len needs the length limit: pass max_new_tokens to PPOActor")
            lengths = batch["loss_mask"].bool().sum(-1)
            penalty = soft_overlong_penalty(lengths, self.max_new_tokens, ov.buffer_len, ov.penalty_factor)
            raw = raw + penalty
            stats["overlong_penalty_mean"] = float(penalty.mean()) if raw.numel() else 0.0
        return transform_rewards(raw, cfg.reward_scale, cfg.reward_bias, cfg.reward_clip), stats

    def _kl_reward(self, batch: TensorDictBase, mask: torch.Tensor) -> torch.Tensor | float:
        """``-kl_coef * KL_t`` per token with ``algorithm.kl_in_reward`` (KL of the sampling-time
        policy to the reference), else 0."""
        cfg = self.config
        if not cfg.kl_in_reward:
            return 0.0
        if "ref_logp" not in batch.keys():
            if self.ref_engine is None:
                raise ValueError("algorithm.kl_in_reward needs reference log-probs: pass ref_engine to PPOActor "
                                 "or put 'ref_logp' in the batch")
            batch["ref_logp"] = self.compute_logp(batch, engine=self.ref_engine)
        old = batch["prox_logp"] if "prox_logp" in batch.keys() else batch["logprobs"]
        return -cfg.kl_coef * kl_penalty(old, batch["ref_logp"], cfg.kl_estimator, mask)

    # --------------------------------------------------------------------- update
    def loss_fn(self):
        """The ``(head, mb) -> scalar`` loss for ``engine.train_batch``, bound to the config:
        ``algorithm.policy_loss`` plus the KL and entropy terms, aggregated."""
        cfg = self.config
        return functools.partial(
            ppo_actor_loss,
            temperature=self.temperature,
            policy_loss=bind_policy_loss(self.policy_loss, cfg),
            use_decoupled_loss=cfg.use_decoupled_loss,
            kl_coef=0.0 if cfg.kl_in_reward else cfg.kl_coef,  # in the reward, not also in the loss
            kl_estimator=cfg.kl_estimator,
            entropy_coef=cfg.entropy_coef,
            loss_agg_mode=cfg.loss_agg_mode,
            agg_constant=self.agg_constant,
            prox_from_forward=cfg.use_decoupled_loss and cfg.n_minibatches == 1,
        )

    def loss_weight_fn(self):
        """The ``mb -> float`` weight matching the aggregation mode (tokens or sequences)."""
        return functools.partial(_weight_fn, mode=self.config.loss_agg_mode)

    def ppo_update(self, batch: TensorDictBase) -> list[dict[str, float]]:
        """``algorithm.n_minibatches`` optimizer steps on ``batch``; one stats dict per step.

        Needs ``logprobs`` (behaviour) and ``advantages``; uses ``prox_logp``
        when present. With ``kl_coef > 0`` the reference log-probs are computed
        with ``ref_engine`` unless the batch already has ``ref_logp``.
        """
        cfg = self.config
        missing = [k for k in ("input_ids", "attention_mask", "loss_mask", "logprobs", "advantages")
                   if k not in batch.keys()]
        if missing:
            hint = " (call compute_advantages first)" if "advantages" in missing else ""
            raise KeyError(f"ppo_update: the batch lacks {missing}{hint}")
        if cfg.kl_coef > 0 and "ref_logp" not in batch.keys():
            if self.ref_engine is None:
                raise ValueError(
                    f"algorithm.kl_coef={cfg.kl_coef} needs reference log-probs: pass ref_engine to "
                    "PPOActor, put 'ref_logp' in the batch, or set kl_coef=0"
                )
            batch["ref_logp"] = self.compute_logp(batch, engine=self.ref_engine)

        loss_fn, weight_fn = self.loss_fn(), self.loss_weight_fn()
        mask = batch["loss_mask"].bool()
        if cfg.overlong.exclude_truncated:
            # Truncated samples leave the loss (a shallow copy: the caller's batch keeps its mask for stats).
            batch = batch.copy()
            batch["loss_mask"] = self.train_mask(batch)
        if "prox_logp" in batch.keys():
            # Whole-batch view of the train-inference mismatch, independent of micro-batching.
            delta = (batch["prox_logp"].float() - batch["logprobs"].float()).abs()
            mismatch = {"logp_mismatch_mean_batch": float(masked_mean(delta, mask)),
                        "logp_mismatch_max_batch": float(delta[mask].max()) if mask.any() else 0.0}
        else:
            mismatch = {}
        out: list[dict[str, float]] = []
        for mb_batch in split_minibatches(batch, cfg.n_minibatches):
            stats = dict(self.engine.train_batch(mb_batch, loss_fn, weight_fn))
            stats.update(self.adv_stats)
            stats.update(mismatch)
            out.append(stats)
        return out
