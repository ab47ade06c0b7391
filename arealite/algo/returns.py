"""Token-level returns and advantages: reward-to-go, GAE, and whitening over the global batch.

A trajectory's scalar reward ``R`` arrives at its last policy token; an optional per-token
reward (``-beta * KL_t`` with ``algorithm.kl_in_reward``) arrives at every policy token.
The time steps of a trajectory are its ``loss_mask`` tokens in order; tokens outside the
mask (prompt, tool output, padding) are skipped, so a multi-turn trajectory's turns are
chained as one episode.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["terminal_rewards", "discounted_returns", "gae", "global_whiten", "collective_device"]


def _check(name: str, t: torch.Tensor, mask: torch.Tensor) -> None:
    if t.shape != mask.shape or mask.dim() != 2:
        raise ValueError(f"'{name}' {tuple(t.shape)} and loss_mask {tuple(mask.shape)} must be one [B, L] shape")


def terminal_rewards(seq_rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]``: each trajectory's ``seq_rewards[b]`` on its last ``loss_mask`` token, 0 elsewhere
    (a row without a loss token gets nothing)."""
    mask = loss_mask.bool()
    L = mask.shape[1]
    pos = torch.arange(L, device=mask.device)
    last = torch.where(mask, pos, torch.full_like(pos, -1)).max(-1).values  # -1: no loss token
    at_last = (pos[None, :] == last[:, None]) & mask
    return torch.where(at_last, seq_rewards.float()[:, None], torch.zeros((), device=mask.device))


def discounted_returns(token_rewards: torch.Tensor, loss_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Reward-to-go ``G_t = sum_{s >= t} gamma^(s - t) r_s`` over the loss tokens of each row
    (``s`` counts loss tokens only); 0 outside ``loss_mask``."""
    _check("token_rewards", token_rewards, loss_mask)
    if not 0 <= gamma <= 1:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    mask = loss_mask.bool()
    r = torch.where(mask, token_rewards.float(), torch.zeros((), device=mask.device))
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], device=r.device)
    for t in range(r.shape[1] - 1, -1, -1):
        running = torch.where(mask[:, t], r[:, t] + gamma * running, running)
        out[:, t] = torch.where(mask[:, t], running, torch.zeros_like(running))
    return out


def gae(token_rewards: torch.Tensor, values: torch.Tensor, loss_mask: torch.Tensor,
        gamma: float = 1.0, lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al., 2016, arXiv:1506.02438).

    With ``V(s_t)`` = ``values[:, t]`` (the critic's value of the state before loss token t)
    and ``V = 0`` after a trajectory's last loss token (the episode ends there):

        delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)
        A_t     = sum_{l >= 0} (gamma * lam)^l * delta_{t+l}      (A_t = delta_t + gamma lam A_{t+1})
        returns = A_t + V(s_t)                                     (the critic's regression target)

    ``lam = 1`` gives the Monte-Carlo return minus the value; ``lam = 0`` the one-step TD
    error. Returns ``(advantages, returns)``, both 0 outside ``loss_mask``.
    """
    _check("token_rewards", token_rewards, loss_mask)
    _check("values", values, loss_mask)
    if not (0 <= gamma <= 1 and 0 <= lam <= 1):
        raise ValueError(f"gamma and lambda must be in [0, 1], got gamma={gamma}, lambda={lam}")
    mask = loss_mask.bool()
    zero = torch.zeros((), device=mask.device)
    r = torch.where(mask, token_rewards.float(), zero)
    v = torch.where(mask, values.detach().float(), zero)
    adv = torch.zeros_like(r)
    next_value = torch.zeros(r.shape[0], device=r.device)
    next_adv = torch.zeros(r.shape[0], device=r.device)
    for t in range(r.shape[1] - 1, -1, -1):
        m = mask[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(m, a, torch.zeros_like(a))
        next_adv = torch.where(m, a, next_adv)
        next_value = torch.where(m, v[:, t], next_value)
    return adv, torch.where(mask, adv + v, zero)


def global_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over the ``mask`` entries of every trainer rank's batch.

    The mean and the (Bessel-corrected) std are those of the global batch: under
    ``torch.distributed`` the sums are all-reduced (a collective: every rank calls it), so
    2 ranks whiten exactly as 1 process holding both halves. 0 outside ``mask``; fewer
    than two entries, or all equal, give 0.
    """
    if mask.shape != values.shape:
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not match values {tuple(values.shape)}")
    mask = mask.bool()
    x = torch.where(mask, values.double(), torch.zeros((), dtype=torch.float64, device=values.device))
    big = torch.finfo(torch.float64).max
    sums = torch.stack([mask.sum().double(), x.sum(),
                        torch.where(mask, x, torch.full_like(x, big)).min(),
                        -torch.where(mask, x, torch.full_like(x, -big)).max()])
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        sums = _all_reduce(sums[:2], dist.ReduceOp.SUM, sums[2:], dist.ReduceOp.MIN)
    count, total, lo, neg_hi = sums.tolist()
    out = torch.zeros_like(values, dtype=torch.float32)
    if count < 2 or lo == -neg_hi:
        return out
    mean = total / count
    sq = torch.where(mask, (x - mean) ** 2, torch.zeros_like(x)).sum().reshape(1)
    if world > 1:
        sq = sq.to(collective_device())
        dist.all_reduce(sq)
    std = (float(sq) / (count - 1)) ** 0.5
    return torch.where(mask, ((x - mean) / (std + eps)).float(), out)


def collective_device() -> torch.device:
    """Where a tensor must be for a collective on the default group (NCCL: this rank's GPU)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(a: torch.Tensor, op_a, b: torch.Tensor, op_b) -> torch.Tensor:
    dev = collective_device()
    a, b = a.to(dev).clone(), b.to(dev).clone()
    dist.all_reduce(a, op=op_a)
    dist.all_reduce(b, op=op_b)
    return torch.cat([a, b]).cpu()
