"""PPO / GRPO losses: pure functions of per-token tensors, and the engine-facing loss function.

Three policies appear in decoupled PPO (Hilton et al., 2021; AReaL):

- the *behaviour* policy that sampled the tokens (log-probs from the server,
  ``mb["logprobs"]``); with asynchronous rollouts it may be several versions old;
- the *proximal* policy, the current weights just before this update
  (``prox_logp``, recomputed by the trainer); the trust region is around it;
- the policy being trained (``logp``, with gradients).

The clipped surrogate uses ``ratio = exp(logp - prox_logp)``; each token is then
weighted by the behaviour importance weight ``w = exp(prox_logp - behav_logp)``
and tokens with ``w > behav_imp_weight_cap`` are dropped (their loss is 0; they
still count in the denominator, so the cap does not inflate the other tokens'
weight). Without the decoupled loss there is one old policy and no weight.

All tensors of one call share a shape: ``[T]`` packed tokens (then sequences
come from ``cu_seqlens``) or ``[B, L]`` rows. Values outside ``loss_mask`` are
never used, so garbage there (e.g. the 0 behaviour log-prob of a prompt token)
can neither overflow ``exp`` nor leak a NaN into the gradient.

The policy term is named in config (``algorithm.policy_loss``): a built-in short
name, or ``module:function`` of your own with the `PolicyLoss` signature. A new
built-in is one function in this file under ``@policy_loss("name")``; the config
accepts the names registered here (`POLICY_LOSSES`). KL and entropy terms and
the aggregation to one scalar are added around it by ``ppo_actor_loss``.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Callable, Literal, Optional

import torch

from arealite.algo.mismatch import behaviour_weight
from arealite.algo.named import resolve_named
from arealite.algo.ratio import clamped_exp, sequence_index
from arealite.api.contracts import HeadOutput, MicroBatch
from arealite.config.problems import ConfigProblem
from arealite.utils.imports import register_into

if TYPE_CHECKING:
    from arealite.config.schema import AlgorithmConfig, ArealiteConfig, MismatchConfig

__all__ = [
    "LossAggMode",
    "KLEstimator",
    "POLICY_LOSSES",
    "PolicyLoss",
    "BoundPolicyLoss",
    "policy_loss",
    "resolve_policy_loss",
    "policy_loss_problems",
    "bind_policy_loss",
    "ppo_clip_loss",
    "ppo_policy_loss",
    "kl_penalty",
    "aggregate_loss",
    "loss_weight",
    "masked_mean",
    "ppo_actor_loss",
]

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KLEstimator = Literal["k1", "k2", "k3"]
_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
#: A policy loss: ``fn(logp, prox_logp, advantages, loss_mask, behav_logp, config) -> (token_loss, stats)``.
#:
#: All tensors share one shape, ``[T]`` (the packed tokens of a micro-batch):
#:
#: - ``logp``: float32 log-probs of the sampled tokens under the weights being trained (with gradient);
#: - ``prox_logp``: the old policy's log-probs, detached: the proximal policy's when it was
#:   recomputed (decoupled PPO), else the behaviour policy's;
#: - ``advantages``: float32, 0 outside ``loss_mask``;
#: - ``loss_mask``: bool, the tokens the policy produced;
#: - ``behav_logp``: the behaviour (inference server) log-probs when the decoupled loss applies
#:   (``algorithm.use_decoupled_loss`` and a proximal policy), else ``None``;
#: - ``config``: the run's ``AlgorithmConfig`` (``eps_clip``, ``c_clip``, ``behav_imp_weight_cap``, ...).
#:
#: Returns the per-token loss (same shape, 0 outside ``loss_mask``; the caller aggregates it with
#: ``algorithm.loss_agg_mode`` and adds the KL and entropy terms) and a dict of 0-dim tensor
#: stats, logged as weighted means over micro-batches (a key ending in ``_max`` as a maximum).
#:
#: A loss that needs to know the sequences (GSPO, sequence-level mismatch correction) declares
#: a keyword parameter ``cu_seqlens``: it then gets the packed micro-batch's boundaries
#: ``[n + 1]`` (see `arealite.algo.ratio.sequence_index`).
PolicyLoss = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], "AlgorithmConfig"],
    tuple[torch.Tensor, dict[str, torch.Tensor]],
]
#: A `PolicyLoss` with its config bound: ``fn(logp, prox_logp, advantages, loss_mask, behav_logp)``.
BoundPolicyLoss = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]],
    tuple[torch.Tensor, dict[str, torch.Tensor]],
]

#: The built-in policy losses by short name; `policy_loss` fills it.
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: register a built-in policy loss under ``name`` (``algorithm.policy_loss: <name>``)."""
    return register_into(POLICY_LOSSES, name, "policy loss")


def resolve_policy_loss(spec: str | PolicyLoss) -> PolicyLoss:
    """The policy loss ``spec`` names: a built-in short name, ``module:function``, or a callable itself.

    Raises ``ValueError`` naming the value and the allowed names.
    """
    return resolve_named(spec, POLICY_LOSSES, "policy loss", "algorithm.policy_loss", 6,
                         "fn(logp, prox_logp, advantages, loss_mask, behav_logp, config) -> (token_loss, stats)")


def policy_loss_problems(cfg: ArealiteConfig) -> list[ConfigProblem]:
    """`algorithm.policy_loss` names a built-in or an importable function taking the policy
    loss's six arguments (a config check, run before anything starts)."""
    try:
        resolve_policy_loss(cfg.algorithm.policy_loss)
    except ValueError as e:
        return [ConfigProblem("algorithm.policy_loss", str(e), cfg.algorithm.policy_loss)]
    return []


def bind_policy_loss(fn: PolicyLoss, config: "AlgorithmConfig") -> BoundPolicyLoss:
    """``fn`` with ``config`` bound, its output checked (what ``ppo_actor_loss`` calls)."""
    return functools.partial(_call_policy_loss, fn, config, _takes_cu_seqlens(fn))


def _takes_cu_seqlens(fn: Callable) -> bool:
    try:
        return "cu_seqlens" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _call_policy_loss(fn: PolicyLoss, config: "AlgorithmConfig", takes_seq: bool, logp: torch.Tensor,
                      prox_logp: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
                      behav_logp: torch.Tensor | None, cu_seqlens: torch.Tensor | None = None,
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    extra = {"cu_seqlens": cu_seqlens} if takes_seq else {}
    out = fn(logp, prox_logp, advantages, loss_mask, behav_logp, config, **extra)
    name = getattr(fn, "__qualname__", repr(fn))
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        raise TypeError(f"policy loss {name} must return (token_loss, stats dict), got {type(out).__name__}")
    token_loss = out[0]
    if not isinstance(token_loss, torch.Tensor) or token_loss.shape != logp.shape:
        got = tuple(token_loss.shape) if isinstance(token_loss, torch.Tensor) else type(token_loss).__name__
        raise ValueError(f"policy loss {name} returned a token loss of shape {got}; "
                         f"it must be per token, shape {tuple(logp.shape)}")
    return out


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` on ``mask`` (0 when the mask is empty, never NaN)."""
    mask = mask.bool()
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum() / mask.sum().clamp(min=1)


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.bool()
    if not mask.any():
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return x[mask].max()


def _check_ppo_args(
    shapes: dict[str, tuple[int, ...]],
    eps_clip: float,
    eps_high: float,
    eps_clip_high: float | None,
    c_clip: float | None,
    behav_imp_weight_cap: float | None,
) -> None:
    if len(set(shapes.values())) != 1:
        raise ValueError(f"ppo_policy_loss needs tensors of one shape, got {shapes}")
    if eps_clip <= 0:
        raise ValueError(f"eps_clip must be > 0, got {eps_clip}")
    if eps_high <= 0:
        raise ValueError(f"eps_clip_high must be > 0 (or None), got {eps_clip_high}")
    if c_clip is not None and c_clip <= 1:
        raise ValueError(f"c_clip (dual clip) must be > 1 (or None to disable), got {c_clip}")
    if behav_imp_weight_cap is not None and behav_imp_weight_cap <= 1:
        raise ValueError(f"behav_imp_weight_cap must be > 1 (or None), got {behav_imp_weight_cap}")


def ppo_policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    c_clip: float | None = None,
    behav_logp: torch.Tensor | None = None,
    behav_imp_weight_cap: float | None = None,
    mismatch: "MismatchConfig | None" = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped-surrogate loss (0 outside ``loss_mask``) and its stats.

    ``loss = max(-A r, -A clip(r, 1 - eps_clip, 1 + eps_clip_high))`` with
    ``r = exp(logp - prox_logp)``; with dual clip, tokens with ``A < 0`` are
    bounded by ``-A c_clip``. If ``behav_logp`` is given (decoupled loss) each
    token is multiplied by ``w = exp(prox_logp - behav_logp)`` and masked out
    where ``w > behav_imp_weight_cap``; ``mismatch`` (TIS/MIS, see `behaviour_weight`)
    bounds that weight further (``cu_seqlens``: the sequences, for its sequence level).
    The log-ratio is clamped to [-20, 20] before ``exp`` (`arealite.algo.ratio`).

    Stats (0-dim tensors, means over loss tokens): ``clip_frac_low``,
    ``clip_frac_high``, ``clip_frac_dual``, ``ratio_mean``, ``approx_kl_prox``
    and, when decoupled, ``imp_weight_mean``, ``imp_weight_max``,
    ``imp_weight_capped_frac``, ``approx_kl_behav``.
    """
    shapes = {k: tuple(v.shape) for k, v in
              (("logp", logp), ("prox_logp", prox_logp), ("advantages", advantages), ("loss_mask", loss_mask))}
    if behav_logp is not None:
        shapes["behav_logp"] = tuple(behav_logp.shape)
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    _check_ppo_args(shapes, eps_clip, eps_high, eps_clip_high, c_clip, behav_imp_weight_cap)

    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    adv = torch.where(mask, advantages.float(), zero)
    prox = prox_logp.detach().float()
    stats: dict[str, torch.Tensor] = {}
    # Tokens kept in the loss: loss tokens whose behaviour weight is within the cap.
    keep, w_kept = mask, None
    if behav_logp is not None:
        keep, w_kept = behaviour_weight(mask, prox, behav_logp, behav_imp_weight_cap, stats, mismatch, cu_seqlens)

    log_ratio = torch.where(mask, logp.float() - prox, zero)
    ratio = clamped_exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    # Clip fractions are over all loss tokens, counting the kept tokens whose clip is active.
    clip_used = (pg_clipped > pg_unclipped) & keep
    stats["clip_frac_low"] = masked_mean((clip_used & (ratio < 1)).float(), mask)
    stats["clip_frac_high"] = masked_mean((clip_used & (ratio > 1)).float(), mask)
    if c_clip is not None:
        # Dual clip: a huge ratio on a negative-advantage token would give an
        # unbounded loss; cap it at -A * c_clip (= c_clip * |A|).
        pg_dual = -adv * c_clip
        dual_used = (adv < 0) & (pg > pg_dual) & keep
        pg = torch.where(dual_used, pg_dual, pg)
        stats["clip_frac_dual"] = masked_mean(dual_used.float(), mask)
    else:
        stats["clip_frac_dual"] = zero.clone()
    stats["ratio_mean"] = masked_mean(ratio.detach(), mask)
    stats["approx_kl_prox"] = masked_mean(-log_ratio.detach(), mask)  # k1 of KL(prox || current)
    if w_kept is not None:
        pg = pg * w_kept
    return torch.where(keep, pg, zero), stats


@policy_loss("ppo")
def ppo_clip_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    behav_logp: torch.Tensor | None,
    config: "AlgorithmConfig",
    *,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate (``ppo_policy_loss``) with ``algorithm.eps_clip``, ``eps_clip_high``,
    ``c_clip`` and, for the decoupled loss, ``behav_imp_weight_cap`` and ``algorithm.mismatch``."""
    return ppo_policy_loss(
        logp, prox_logp, advantages, loss_mask,
        eps_clip=config.eps_clip, eps_clip_high=config.eps_clip_high, c_clip=config.c_clip,
        behav_logp=behav_logp, behav_imp_weight_cap=config.behav_imp_weight_cap,
        mismatch=config.mismatch, cu_seqlens=cu_seqlens,
    )


def kl_penalty(
    logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator = "k3",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens (Schulman's k1/k2/k3).

    With ``d = logp - ref_logp``: ``k1 = d`` (unbiased, can be negative),
    ``k2 = d^2 / 2``, ``k3 = exp(-d) - 1 + d`` (unbiased and >= 0). 0 outside ``mask``.
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and ref_logp {tuple(ref_logp.shape)} differ in shape")
    d = logp.float() - ref_logp.detach().float()
    if mask is not None:
        d = torch.where(mask.bool(), d, torch.zeros((), dtype=d.dtype, device=d.device))
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"unknown kl_estimator {estimator!r}; choose k1, k2 or k3")


def _per_sequence(values: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None):
    """``(sum of values on mask, count of mask)`` per sequence."""
    mask = mask.bool()
    v = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if values.dim() == 2:
        return v.sum(-1), mask.sum(-1)
    if values.dim() != 1:
        raise ValueError(f"expected [T] or [B, L] token values, got {tuple(values.shape)}")
    if cu_seqlens is None:
        raise ValueError("packed [T] values need cu_seqlens for a seq-mean aggregation")
    idx, n = sequence_index(mask, cu_seqlens)
    sums = torch.zeros(n + 1, dtype=v.dtype, device=v.device).index_add(0, idx, v)
    counts = torch.zeros(n + 1, dtype=torch.long, device=v.device).index_add(0, idx, mask.long())
    return sums[:n], counts[:n]


def _check_mode(mode: str, agg_constant: float | None) -> None:
    if mode not in _AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {_AGG_MODES}")
    if mode == "seq-mean-token-sum" and not (agg_constant and agg_constant > 0):
        raise ValueError(
            "loss_agg_mode='seq-mean-token-sum' needs a positive length normaliser: "
            "set algorithm.loss_agg_constant or pass max_new_tokens"
        )


def aggregate_loss(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggMode = "token-mean",
    cu_seqlens: torch.Tensor | None = None,
    agg_constant: float | None = None,
) -> torch.Tensor:
    """Token values -> one scalar, the mean in the units of ``loss_weight``.

    - ``token-mean``: mean over all loss tokens;
    - ``seq-mean-token-mean``: mean over sequences of each sequence's token mean;
    - ``seq-mean-token-sum``: mean over sequences of (token sum / ``agg_constant``).

    Sequences without a loss token are left out of the seq means; an empty
    mask gives 0 (with a zero gradient), never NaN.
    """
    _check_mode(mode, agg_constant)
    if mask.shape != values.shape:
        raise ValueError(f"mask {tuple(mask.shape)} does not match values {tuple(values.shape)}")
    if mode == "token-mean":
        return masked_mean(values, mask)
    sums, counts = _per_sequence(values, mask, cu_seqlens)
    has_tokens = counts > 0
    if mode == "seq-mean-token-mean":
        per_seq = sums / counts.clamp(min=1)
    else:
        per_seq = sums / agg_constant
    return torch.where(has_tokens, per_seq, torch.zeros_like(per_seq)).sum() / has_tokens.sum().clamp(min=1)


def loss_weight(
    mask: torch.Tensor, mode: LossAggMode = "token-mean", cu_seqlens: torch.Tensor | None = None
) -> float:
    """How many units ``aggregate_loss`` averaged over: loss tokens, or sequences with a loss token."""
    if mode not in _AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {_AGG_MODES}")
    if mode == "token-mean":
        return float(mask.bool().sum())
    _, counts = _per_sequence(torch.zeros(mask.shape, device=mask.device), mask, cu_seqlens)
    return float((counts > 0).sum())


def _ppo_term(logp: torch.Tensor, prox_logp: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
              behav_logp: torch.Tensor | None, cu_seqlens: torch.Tensor | None = None,
              **knobs: float | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return ppo_policy_loss(logp, prox_logp, advantages, loss_mask, behav_logp=behav_logp, cu_seqlens=cu_seqlens,
                           **knobs)


def _check_micro_batch(mb: MicroBatch) -> None:
    for key in ("labels", "loss_mask", "logprobs", "advantages"):
        if key not in mb:
            raise KeyError(f"micro-batch lacks '{key}' (has {sorted(mb)}); "
                           "run PPOActor.compute_advantages before ppo_update")


@torch.no_grad()
def _logged_stats(
    mb: MicroBatch, pg: torch.Tensor, logp: torch.Tensor, entropy: torch.Tensor, prox: torch.Tensor | None,
    mask: torch.Tensor, loss_agg_mode: LossAggMode, agg_constant: float | None,
) -> dict[str, torch.Tensor]:
    """The figures every step logs besides the policy loss's own stats."""
    behav = mb["logprobs"]
    stats = {
        "pg_loss": aggregate_loss(pg.detach(), mask, loss_agg_mode, mb.get("cu_seqlens"), agg_constant),
        "entropy": masked_mean(entropy.detach(), mask),
        "logp_mean": masked_mean(logp.detach(), mask),
    }
    if prox is not None:
        # Train-inference mismatch: recomputed proximal vs the server's behaviour log-probs.
        delta = (prox.float() - behav.float()).abs()
        stats["logp_mismatch_mean"] = masked_mean(delta, mask)
        stats["logp_mismatch_max"] = _masked_max(delta, mask)
    stats["n_loss_tokens"] = mask.sum().float()
    return stats


def ppo_actor_loss(
    head: HeadOutput,
    mb: MicroBatch,
    *,
    temperature: float,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    c_clip: float | None = None,
    use_decoupled_loss: bool = True,
    behav_imp_weight_cap: float | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    entropy_coef: float = 0.0,
    loss_agg_mode: LossAggMode = "token-mean",
    agg_constant: float | None = None,
    prox_from_forward: bool = False,
    policy_loss: BoundPolicyLoss | None = None,
) -> torch.Tensor:
    """The loss function given to ``engine.train_batch``: ``(head, mb) -> scalar``.

    ``head`` is the micro-batch's `HeadOutput`: the log-probs and entropies come from its
    fused chunked head (no ``[T, V]`` logits are materialised, in the forward nor the backward).

    Reads the packed micro-batch keys ``labels``, ``loss_mask``, ``logprobs``
    (behaviour), ``advantages``, optional ``prox_logp`` and ``ref_logp`` (needed
    when ``kl_coef > 0``) and ``cu_seqlens``. The old policy is ``prox_logp``
    when present, else the behaviour log-probs; the behaviour importance weight
    applies only with ``use_decoupled_loss`` and a proximal policy. Puts float
    stats into ``mb["_stats"]``.

    ``policy_loss``: the per-token policy term (`bind_policy_loss` of a `PolicyLoss`);
    ``None`` is ``ppo_policy_loss`` with ``eps_clip``, ``eps_clip_high``, ``c_clip`` and
    ``behav_imp_weight_cap`` (those four are used by nothing else).

    ``prox_from_forward``: with no ``prox_logp`` in the micro-batch, the proximal
    log-probs are this forward's own, detached. Exact when the whole batch is one
    optimizer step (``n_minibatches == 1``): every micro-batch then runs on the
    weights before the update, which is what a separate ``compute_logp`` pass
    would score, so that pass (a third of the step's compute) is skipped.
    """
    _check_micro_batch(mb)
    mask = mb["loss_mask"].bool()
    behav = mb["logprobs"]
    prox = mb.get("prox_logp")
    # The entropy is a stat unless entropy_coef > 0; its gradient costs nothing when unused.
    logp, entropy = head.logprobs_entropy(mb["labels"], temperature)

    if prox is None and prox_from_forward:
        prox = logp.detach()
    decoupled = use_decoupled_loss and prox is not None
    if policy_loss is None:
        policy_loss = functools.partial(_ppo_term, eps_clip=eps_clip, eps_clip_high=eps_clip_high,
                                        c_clip=c_clip, behav_imp_weight_cap=behav_imp_weight_cap)
    pg, stats = policy_loss(logp, prox if prox is not None else behav, mb["advantages"], mask,
                            behav if decoupled else None, cu_seqlens=mb.get("cu_seqlens"))
    token_loss = pg
    if kl_coef > 0:
        if "ref_logp" not in mb:
            raise KeyError("algorithm.kl_coef > 0 needs 'ref_logp' in the batch: give PPOActor a ref_engine")
        kl = kl_penalty(logp, mb["ref_logp"], kl_estimator, mask)
        token_loss = token_loss + kl_coef * kl
        stats["kl_ref"] = masked_mean(kl.detach(), mask)
    if entropy_coef > 0:
        token_loss = token_loss - entropy_coef * entropy

    loss = aggregate_loss(token_loss, mask, loss_agg_mode, mb.get("cu_seqlens"), agg_constant)
    stats.update(_logged_stats(mb, pg, logp, entropy, prox, mask, loss_agg_mode, agg_constant))
    prev = mb.get("_stats")
    out = dict(prev) if isinstance(prev, dict) else {}
    out.update({k: float(v) for k, v in stats.items()})
    mb["_stats"] = out
    return loss
