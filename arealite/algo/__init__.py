"""Algorithms: log-probs, advantages and PPO/GRPO losses as pure functions; PPOActor ties them to an engine."""

from arealite.algo.actor import PPOActor, logprob_hook, split_minibatches
from arealite.algo.advantage import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    advantage_estimator,
    broadcast_to_tokens,
    group_advantages,
    normalize_advantages,
    resolve_advantage_estimator,
    stepwise_advantages,
    transform_rewards,
)
from arealite.algo.logprob import gather_logprobs, gather_logprobs_entropy, token_entropy
from arealite.algo.loss import (
    POLICY_LOSSES,
    PolicyLoss,
    aggregate_loss,
    kl_penalty,
    loss_weight,
    masked_mean,
    policy_loss,
    ppo_actor_loss,
    ppo_clip_loss,
    ppo_policy_loss,
    resolve_policy_loss,
)
from arealite.algo.sft import build_sft_batch, sft_loss_fn, sft_loss_weight

# Modules that register built-ins (`@policy_loss`, `@advantage_estimator`) on import.
from arealite.algo import gspo, reinforce  # noqa: E402,F401  (isort: skip)

__all__ = [
    "PPOActor",
    "logprob_hook",
    "split_minibatches",
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "advantage_estimator",
    "resolve_advantage_estimator",
    "broadcast_to_tokens",
    "group_advantages",
    "normalize_advantages",
    "stepwise_advantages",
    "transform_rewards",
    "gather_logprobs",
    "gather_logprobs_entropy",
    "token_entropy",
    "aggregate_loss",
    "kl_penalty",
    "loss_weight",
    "masked_mean",
    "POLICY_LOSSES",
    "PolicyLoss",
    "policy_loss",
    "resolve_policy_loss",
    "ppo_actor_loss",
    "ppo_clip_loss",
    "ppo_policy_loss",
    "build_sft_batch",
    "sft_loss_fn",
    "sft_loss_weight",
]
