"""REINFORCE++ (Hu, 2025, arXiv:2501.03262): REINFORCE with PPO's tricks and no critic.

**REINFORCE++** keeps no per-prompt baseline. The per-token reward is the trajectory's
reward ``R`` at its last token minus a KL penalty to the reference model at every token,
and the advantage is the reward-to-go, whitened over the *global* batch:

    r_t = 1[t = last] R - beta * KL_t,     A_t = sum_{s >= t} gamma^(s - t) r_s,
    A_t <- (A_t - mean_batch(A)) / std_batch(A)

(``algorithm.kl_in_reward: true`` with ``kl_coef = beta``; ``adv_norm: batch``.)
Normalising over the whole batch instead of within a group keeps the estimate unbiased
for small groups and stable with one sample per prompt.

**REINFORCE++-baseline** (the paper's variant for reasoning tasks, several samples per
prompt) subtracts the group mean reward first, then whitens over the global batch; its KL
term goes in the loss (``kl_in_reward: false``, ``kl_estimator: k2`` or ``k3``):

    A_i = (R_i - mean_group(R)),    A <- (A - mean_batch(A)) / std_batch(A)

Both estimators below are the per-trajectory step; the token-level rest (the KL reward,
the reward-to-go, the global whitening) is done by `PPOActor` from the config
(`arealite.algo.returns`). The config requires ``adv_norm: batch`` with either.
"""

from __future__ import annotations

import torch

from arealite.algo.advantage import _Groups, advantage_estimator

__all__ = ["reinforce_pp_advantages", "reinforce_pp_baseline_advantages", "GLOBAL_NORM_ESTIMATORS"]

#: Estimators defined with whitening over the global batch (``algorithm.adv_norm: batch``).
GLOBAL_NORM_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline")


@advantage_estimator("reinforce_pp")
def reinforce_pp_advantages(rewards: torch.Tensor, group_id: torch.Tensor) -> torch.Tensor:
    """REINFORCE++: the reward itself (no baseline; the global whitening centres it)."""
    return rewards.float().clone()


@advantage_estimator("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(rewards: torch.Tensor, group_id: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline: the reward minus its group's mean (then whitened over the batch).

    Unlike ``drgrpo`` it is not zeroed for groups without signal: the centred value is
    already 0 there, and a group of one keeps ``R - R = 0`` too.
    """
    return _Groups.of(rewards, group_id).centered.float()
