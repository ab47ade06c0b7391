"""Rewards to advantages: pure functions of tensors.

A *group* is the set of trajectories sampled from one prompt; it is given by a
``group_id [B]`` tensor whose rows need not be contiguous. The built-in
estimators (``algorithm.adv_estimator``):

- ``grpo``: ``(r - mean_g) / (std_g + eps)`` (std with Bessel's correction, as
  in DeepSeekMath / TRL);
- ``drgrpo``: ``r - mean_g`` (Dr.GRPO drops the std, which biases towards
  easy/hard prompts);
- ``rloo``: ``r - mean of the other samples of the group`` =
  ``n / (n - 1) * (r - mean_g)``;
- ``none``: the raw (transformed) reward.

Defined cases: a group of one sample, and a group whose rewards are all equal,
carry no learning signal and get advantage exactly 0 (never NaN) for every
built-in but ``none``.

Your own estimator is any function with the `AdvantageEstimator` signature,
named in config as ``algorithm.adv_estimator: mypkg.module:my_estimator``. A
new built-in is one function in this file under ``@advantage_estimator("name")``;
the config accepts the names registered here (`ADVANTAGE_ESTIMATORS`).

Multi-step trajectories (an agent run split into one training row per step)
use ``stepwise_advantages``: the advantage is computed per *run* from its final
step's reward and broadcast to all the run's steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

import torch

from arealite.algo.named import resolve_named
from arealite.config.problems import ConfigProblem
from arealite.utils.imports import register_into

if TYPE_CHECKING:
    from arealite.config.schema import ArealiteConfig

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "advantage_estimator",
    "resolve_advantage_estimator",
    "estimator_problems",
    "transform_rewards",
    "group_advantages",
    "stepwise_advantages",
    "normalize_advantages",
    "broadcast_to_tokens",
]

#: An advantage estimator: ``fn(rewards, group_id) -> advantages``.
#:
#: - ``rewards``: float32 ``[B]``, one per trajectory, already transformed by
#:   ``algorithm.reward_scale/reward_bias/reward_clip`` and finite;
#: - ``group_id``: int64 ``[B]``; the samples of one prompt share it (rows of a
#:   group need not be contiguous);
#: - returns float ``[B]``, finite: one advantage per trajectory. It is then put
#:   on every token of the trajectory's ``loss_mask`` (and whitened over the
#:   batch with ``algorithm.adv_norm: batch``).
#:
#: It must be a pure function of its arguments (no in-place change to them).
AdvantageEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: The built-in estimators by short name; `advantage_estimator` fills it.
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}

#: Added to the group std by ``grpo`` (a group's std can be tiny but not 0: equal rewards get 0 first).
_STD_EPS = 1e-6


def advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator: register a built-in estimator under ``name`` (``algorithm.adv_estimator: <name>``)."""
    return register_into(ADVANTAGE_ESTIMATORS, name, "advantage estimator")


def resolve_advantage_estimator(spec: str | AdvantageEstimator) -> AdvantageEstimator:
    """The estimator ``spec`` names: a built-in short name, ``module:function``, or a callable itself.

    Raises ``ValueError`` naming the value and the allowed names.
    """
    return resolve_named(spec, ADVANTAGE_ESTIMATORS, "advantage estimator", "algorithm.adv_estimator", 2,
                         "fn(rewards, group_id) -> advantages")


def estimator_problems(cfg: ArealiteConfig) -> list[ConfigProblem]:
    """`algorithm.adv_estimator` names a built-in, `gae`, or an importable function taking
    ``(rewards, group_id)`` (a config check, run before anything starts)."""
    name = cfg.algorithm.adv_estimator
    if name == "gae":  # token-level, from the critic's values: PPOActor computes it, not the registry
        return []
    try:
        resolve_advantage_estimator(name)
    except ValueError as e:
        return [ConfigProblem("algorithm.adv_estimator", f"{e} (or gae, PPO with a critic)", name)]
    return []


def _check_1d(name: str, t: torch.Tensor, n: int | None = None) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"'{name}' must be a 1-D tensor [B], got {shape}")
    if n is not None and t.shape[0] != n:
        raise ValueError(f"'{name}' has {t.shape[0]} rows but 'rewards' has {n}; one value per trajectory")


def transform_rewards(
    rewards: torch.Tensor, scale: float = 1.0, bias: float = 0.0, clip: float | None = None
) -> torch.Tensor:
    """``clip((r + bias) * scale, -clip, clip)``; ``clip=None`` leaves the range open."""
    if not torch.isfinite(rewards).all():
        raise ValueError("'rewards' holds NaN or inf; fix the reward function before training")
    out = (rewards.float() + bias) * scale
    if clip is not None:
        if clip <= 0:
            raise ValueError(f"reward clip must be > 0 (or None), got {clip}")
        out = out.clamp(-clip, clip)
    return out


def _segments(ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Dense segment index in [0, n) for arbitrary integer ids, and n."""
    uniq, inv = torch.unique(ids, return_inverse=True)
    return inv, uniq.numel()


class _Groups(NamedTuple):
    """Per-row group statistics the built-in estimators share (float64, so that the mean of
    equal rewards leaves no rounding crumbs)."""

    centered: torch.Tensor  # r - mean of its group
    size: torch.Tensor  # the size of its group
    var: torch.Tensor  # the Bessel-corrected variance of its group
    no_signal: torch.Tensor  # its group has one sample or equal rewards

    @classmethod
    def of(cls, rewards: torch.Tensor, group_id: torch.Tensor) -> "_Groups":
        r = rewards.double()
        seg, n_groups = _segments(group_id)
        zeros = torch.zeros(n_groups, dtype=torch.float64, device=r.device)
        count = zeros.index_add(0, seg, torch.ones_like(r))
        centered = r - (zeros.index_add(0, seg, r) / count)[seg]
        var = zeros.index_add(0, seg, centered * centered) / (count - 1).clamp(min=1)
        gmax = zeros.scatter_reduce(0, seg, r, "amax", include_self=False)
        gmin = zeros.scatter_reduce(0, seg, r, "amin", include_self=False)
        return cls(centered, count[seg], var[seg], (gmax == gmin)[seg])

    def finish(self, adv: torch.Tensor) -> torch.Tensor:
        """0 where the group carries no signal, as float32."""
        return torch.where(self.no_signal, torch.zeros_like(adv), adv).float()


@advantage_estimator("grpo")
def grpo_advantages(rewards: torch.Tensor, group_id: torch.Tensor) -> torch.Tensor:
    """GRPO: the reward standardised within its group, ``(r - mean_g) / (std_g + eps)``."""
    g = _Groups.of(rewards, group_id)
    return g.finish(g.centered / (g.var.sqrt() + _STD_EPS))


@advantage_estimator("drgrpo")
def drgrpo_advantages(rewards: torch.Tensor, group_id: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO: the reward minus its group's mean (no division by the std)."""
    g = _Groups.of(rewards, group_id)
    return g.finish(g.centered)


@advantage_estimator("rloo")
def rloo_advantages(rewards: torch.Tensor, group_id: torch.Tensor) -> torch.Tensor:
    """RLOO: the reward minus the mean of the other samples of its group."""
    g = _Groups.of(rewards, group_id)
    return g.finish(g.centered * g.size / (g.size - 1).clamp(min=1))


@advantage_estimator("none")
def raw_reward_advantages(rewards: torch.Tensor, group_id: torch.Tensor) -> torch.Tensor:
    """No baseline: the (transformed) reward itself."""
    return rewards.float().clone()


def group_advantages(
    rewards: torch.Tensor,
    group_id: torch.Tensor,
    estimator: str | AdvantageEstimator = "grpo",
) -> torch.Tensor:
    """Per-trajectory advantages ``[B]`` from rewards ``[B]`` and their ``group_id [B]``.

    ``estimator``: a built-in name, ``module:function``, or an `AdvantageEstimator`.
    """
    fn = resolve_advantage_estimator(estimator)
    _check_1d("rewards", rewards)
    _check_1d("group_id", group_id, rewards.shape[0])
    if rewards.shape[0] == 0:
        return rewards.float().clone()
    if not torch.isfinite(rewards).all():
        raise ValueError("'rewards' holds NaN or inf; fix the reward function before training")
    adv = fn(rewards.float(), group_id)
    if not isinstance(adv, torch.Tensor) or tuple(adv.shape) != tuple(rewards.shape):
        got = tuple(adv.shape) if isinstance(adv, torch.Tensor) else type(adv).__name__
        raise ValueError(f"advantage estimator {getattr(fn, '__qualname__', fn)!r} returned {got}; "
                         f"it must return a tensor of shape {tuple(rewards.shape)} (one value per trajectory)")
    if not torch.isfinite(adv).all():
        raise ValueError(f"advantage estimator {getattr(fn, '__qualname__', fn)!r} returned NaN or inf")
    return adv.float()


def stepwise_advantages(
    rewards: torch.Tensor,
    group_id: torch.Tensor,
    traj_id: torch.Tensor,
    step_id: torch.Tensor,
    estimator: str | AdvantageEstimator = "grpo",
    divide_by_steps: bool = False,
) -> torch.Tensor:
    """Advantages ``[B]`` for multi-step runs, one row per step.

    Rows with the same ``traj_id`` are the steps of one run; its final step is
    the row with the largest ``step_id`` and carries the run's reward. Runs with
    the same ``group_id`` form a group; the group advantage of each run (from
    its final reward) is given to all its steps, divided by the run's number
    of steps if ``divide_by_steps``.
    """
    _check_1d("rewards", rewards)
    B = rewards.shape[0]
    for name, t in (("group_id", group_id), ("traj_id", traj_id), ("step_id", step_id)):
        _check_1d(name, t, B)
    if B == 0:
        return rewards.float().clone()

    tseg, n_runs = _segments(traj_id)
    big = torch.iinfo(torch.int64)
    last_step = torch.full((n_runs,), big.min, dtype=torch.int64, device=step_id.device)
    last_step = last_step.scatter_reduce(0, tseg, step_id.long(), "amax")
    is_final = step_id.long() == last_step[tseg]
    n_final = torch.zeros(n_runs, dtype=torch.int64, device=tseg.device).index_add(0, tseg, is_final.long())
    if (n_final != 1).any():
        bad = int(torch.unique(traj_id)[(n_final != 1).nonzero()[0, 0]])
        raise ValueError(
            f"traj_id {bad} has {int(n_final.max())} rows with its largest step_id; "
            "each run's step_id values must be distinct"
        )
    g_lo = torch.full((n_runs,), big.max, dtype=torch.int64, device=tseg.device)
    g_hi = torch.full((n_runs,), big.min, dtype=torch.int64, device=tseg.device)
    g_lo = g_lo.scatter_reduce(0, tseg, group_id.long(), "amin")
    g_hi = g_hi.scatter_reduce(0, tseg, group_id.long(), "amax")
    if (g_lo != g_hi).any():
        bad = int(torch.unique(traj_id)[(g_lo != g_hi).nonzero()[0, 0]])
        raise ValueError(f"the steps of traj_id {bad} carry different group_id values; a run belongs to one group")

    final_rows = is_final.nonzero().squeeze(-1)
    final_of_run = torch.empty(n_runs, dtype=torch.long, device=tseg.device)
    final_of_run[tseg[final_rows]] = final_rows
    run_adv = group_advantages(rewards[final_of_run], group_id[final_of_run], estimator)
    adv = run_adv[tseg]
    if divide_by_steps:
        n_steps = torch.zeros(n_runs, dtype=torch.float32, device=tseg.device).index_add(
            0, tseg, torch.ones(B, device=tseg.device)
        )
        adv = adv / n_steps[tseg]
    return adv


def normalize_advantages(
    adv: torch.Tensor, mask: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """Whiten advantages over the whole batch: ``(a - mean) / (std + eps)`` on ``mask``.

    Entries outside ``mask`` are 0 in the result. Fewer than two entries, or
    all equal, give 0.
    """
    if mask is None:
        mask = torch.ones_like(adv, dtype=torch.bool)
    if mask.shape != adv.shape:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not match advantages {tuple(adv.shape)}")
    mask = mask.bool()
    vals = adv.double()[mask]
    out = torch.zeros_like(adv, dtype=torch.float32)
    if vals.numel() < 2 or vals.max() == vals.min():
        return out
    mean = vals.mean()
    std = vals.std()  # Bessel-corrected
    out[mask] = ((vals - mean) / (std + eps)).float()
    return out


def broadcast_to_tokens(seq_adv: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Per-trajectory advantages ``[B]`` -> per-token ``[B, L]``, 0 outside ``loss_mask``."""
    if loss_mask.dim() != 2 or loss_mask.shape[0] != seq_adv.shape[0]:
        raise ValueError(
            f"loss_mask must be [B={seq_adv.shape[0]}, L], got {tuple(loss_mask.shape)}"
        )
    return torch.where(loss_mask.bool(), seq_adv.float()[:, None], torch.zeros((), dtype=torch.float32))
