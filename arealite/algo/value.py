"""The critic's loss and diagnostics: pure functions of per-token tensors.

The value model scores every state with a scalar head on the policy's backbone; its
output at position t-1 (after reading token t-1) is ``V(s_t)``, the value of the state in
which token t is generated, so in the trainer's layout ``values[b, t]`` lines up with
``logprobs[b, t]`` and ``advantages[b, t]``.

Clipped value loss (PPO2, Schulman et al. 2017 as implemented in OpenAI baselines; also
verl and OpenRLHF), with ``V_old`` the values the advantages were computed from and
``G`` the GAE returns:

    V_clip = V_old + clip(V - V_old, -eps_v, eps_v)
    L_V    = 1/2 * max( (V - G)^2, (V_clip - G)^2 )

so one update cannot move a value estimate far from the one the advantages used.
``eps_v = None`` gives the plain squared error ``1/2 (V - G)^2``.

Explained variance ``1 - Var(G - V) / Var(G)`` says how much of the returns' variance
the critic accounts for: 1 is perfect, 0 no better than a constant, below 0 worse.
"""

from __future__ import annotations

import torch

from arealite.api.contracts import HeadOutput, MicroBatch

__all__ = ["value_loss", "explained_variance", "value_hook"]


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
    value_clip: float | None = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped value loss (0 outside ``mask``) and stats ``value_clip_frac``,
    ``value_mean``, ``return_mean``."""
    if not (values.shape == old_values.shape == returns.shape == mask.shape):
        raise ValueError(f"value_loss needs tensors of one shape, got values {tuple(values.shape)}, old_values "
                         f"{tuple(old_values.shape)}, returns {tuple(returns.shape)}, mask {tuple(mask.shape)}")
    if value_clip is not None and value_clip <= 0:
        raise ValueError(f"value_clip must be > 0 (or None), got {value_clip}")
    mask = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=values.device)
    v = values.float()
    g = torch.where(mask, returns.float(), zero)
    err = (v - g) ** 2
    stats: dict[str, torch.Tensor] = {}
    if value_clip is not None:
        old = old_values.detach().float()
        v_clip = old + (v - old).clamp(-value_clip, value_clip)
        err_clip = (v_clip - g) ** 2
        used = (err_clip > err) & mask
        err = torch.maximum(err, err_clip)
        stats["value_clip_frac"] = _mean(used.float(), mask)
    else:
        stats["value_clip_frac"] = zero.clone()
    stats["value_mean"] = _mean(v.detach(), mask)
    stats["return_mean"] = _mean(g, mask)
    return torch.where(mask, 0.5 * err, zero), stats


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(returns - values) / Var(returns)`` over ``mask`` (0.0 when the returns are constant,
    up to rounding)."""
    mask = mask.bool()
    g, v = returns.double()[mask], values.double()[mask]
    if g.numel() < 2:
        return 0.0
    var_g = g.var(unbiased=False)
    if var_g <= 1e-12:  # (near-)constant returns: nothing to explain (and no 1e14 from rounding)
        return 0.0
    return float(1.0 - (g - v).var(unbiased=False) / var_g)


def value_hook(head: HeadOutput, mb: MicroBatch) -> torch.Tensor:
    """``engine.forward`` post-hook of a value model: its ``[T, 1]`` head output as ``[T]`` values."""
    out = head.logits()
    if out.dim() != 2 or out.shape[-1] != 1:
        raise ValueError(f"a value model outputs [T, 1] per token, got {tuple(out.shape)}")
    return out[:, 0].float()


def _mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum() / mask.sum().clamp(min=1)
