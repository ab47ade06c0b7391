"""The RL algorithm: rewards, advantages, the policy loss and its corrections (`algorithm`,
`algorithm.mismatch`, `algorithm.overlong`). Rules across its fields: `algo_checks`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from arealite.config.section import Section


class MismatchConfig(Section):
    mode: Literal["none", "tis", "mis"] = "none"
    """Rollout-train mismatch correction between the server's and the trainer's log-probs of
    the sampled tokens (needs `use_decoupled_loss`): `tis` truncates the importance weight
    into [`lower`, `upper`], `mis` leaves tokens (or sequences) outside it out of the loss,
    `none` only logs the mismatch (see `arealite.algo.mismatch`)."""
    level: Literal["token", "sequence"] = "token"
    """`token`: each token's weight; `sequence`: the geometric mean of a sequence's weights,
    on all its tokens."""
    upper: float = Field(2.0, gt=1)
    """Upper bound of the importance weight (> 1)."""
    lower: float | None = Field(None, ge=0, lt=1)
    """Lower bound (in [0, 1)); null = one-sided (only `upper`)."""


class OverlongConfig(Section):
    buffer_len: int | None = Field(None, ge=1)
    """DAPO soft overlong punishment: over the last `buffer_len` tokens before
    `generation.max_new_tokens` the reward gets a penalty ramping from 0 to
    -`penalty_factor` (null = off; see `arealite.algo.overlong`)."""
    penalty_factor: float = Field(1.0, ge=0)
    """Size of the full overlong penalty."""
    exclude_truncated: bool = False
    """DAPO overlong filtering: leave samples cut at the length limit out of the loss."""


class AlgorithmConfig(Section):
    adv_estimator: str = Field("grpo", min_length=1)
    """Advantage estimator: a built-in, `grpo` (group mean/std), `drgrpo` (group mean), `rloo`
    (leave-one-out), `reinforce_pp` / `reinforce_pp_baseline` (REINFORCE++, with `adv_norm:
    batch`), `gae` (PPO with a critic: needs `critic.enabled`), `none` (raw reward), or
    `module:function` of your own, called as `fn(rewards [B], group_id [B]) -> advantages [B]`
    (see `arealite.algo.advantage`)."""
    policy_loss: str = Field("ppo", min_length=1)
    """Policy loss: a built-in, `ppo` (clipped surrogate with `eps_clip`, `c_clip` and the
    decoupled behaviour weight), `gspo` / `gspo_token` (sequence-level ratio and clipping;
    use small clip ranges, e.g. `eps_clip: 3.0e-4`, `eps_clip_high: 4.0e-4`), or
    `module:function` of your own, called per micro-batch as
    `fn(logp, prox_logp, advantages, loss_mask, behav_logp, config) -> (token_loss, stats)`
    (see `arealite.algo.loss`). KL and entropy terms and `loss_agg_mode` apply around it."""
    adv_norm: Literal["none", "batch"] = "none"
    """Extra normalisation of advantages over the whole batch."""
    reward_scale: float = 1.0
    """Rewards are mapped to `clip((r + bias) * scale)`."""
    reward_bias: float = 0.0
    """Added to rewards before scaling."""
    reward_clip: float | None = Field(None, gt=0)
    """Clip scaled rewards to [-reward_clip, reward_clip] (None = no clipping)."""
    eps_clip: float = Field(0.2, gt=0)
    """PPO clip epsilon (lower side, and upper side unless `eps_clip_high` is set)."""
    eps_clip_high: float | None = Field(None, gt=0)
    """Upper clip epsilon (clip-higher, DAPO); None = `eps_clip`."""
    c_clip: float | None = Field(None, gt=1)
    """Dual-clip constant (> 1) bounding the loss of negative-advantage tokens; None = off."""
    use_decoupled_loss: bool = True
    """Decoupled PPO: proximal log-probs are recomputed before the update; behaviour
    log-probs from the server weight the loss (importance weight capped)."""
    behav_imp_weight_cap: float | None = Field(5.0, gt=1)
    """Tokens whose behaviour importance weight exceeds this are masked out (None = no cap)."""
    routing_replay: Literal["none", "r3"] = "none"
    """Mixture-of-experts models: `r3` asks the servers for the experts they routed each token
    to (`return_routed_experts`; servers need `--enable-return-routed-experts`) and the trainer's
    forwards use them instead of its own top-k (docs/moe.md); `none`: the trainer's router chooses."""
    kl_coef: float = Field(0.0, ge=0)
    """Coefficient of the KL penalty to the reference model (0 = no reference model)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman's k1, k2, k3)."""
    kl_in_reward: bool = False
    """Put the KL penalty in the per-token reward (`-kl_coef * KL_t`, REINFORCE++ and classic
    RLHF PPO) instead of in the loss; needs `kl_coef > 0`."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount of token rewards in GAE and in the reward-to-go of the other estimators
    (< 1: earlier tokens get less of the final reward; 1: every token gets the advantage)."""
    gae_lambda: float = Field(1.0, ge=0, le=1)
    """GAE lambda (`adv_estimator: gae`): 1 = Monte-Carlo return minus the value, 0 = one-step TD."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus coefficient."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How token losses become one scalar."""
    loss_agg_constant: float | None = Field(None, gt=0)
    """Length normaliser of `seq-mean-token-sum` (None = `generation.max_new_tokens`)."""
    n_minibatches: int = Field(1, ge=1)
    """Optimizer steps per training batch (the batch is split into this many mini-batches)."""
    stepwise_divide_by_steps: bool = False
    """Multi-step trajectories: divide the broadcast advantage by the number of steps."""
    mismatch: MismatchConfig = Field(default_factory=MismatchConfig)
    """Rollout-train mismatch correction (TIS / MIS)."""
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    """DAPO's overlong reward shaping and filtering."""
