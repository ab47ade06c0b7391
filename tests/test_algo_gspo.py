"""GSPO and GSPO-token against hand-worked numbers and a per-sequence implementation of the paper's objective."""

from __future__ import annotations

import math

import pytest
import torch

from arealite.algo.gspo import gspo_policy_loss
from arealite.algo.loss import aggregate_loss, bind_policy_loss, resolve_policy_loss
from arealite.config.schema import AlgorithmConfig


def paper_objective(logp, prox, adv, lengths, eps_lo, eps_hi):
    """-J_GSPO = -1/G sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean log-ratio), one sequence at a time
    (sequences without tokens are left out of the mean, as the seq-mean aggregation does)."""
    terms, start = [], 0
    for n, a in zip(lengths, adv):
        if n:
            lr = logp[start:start + n] - prox[start:start + n]
            s = torch.exp(lr.mean())
            terms.append(torch.minimum(s * a, torch.clamp(s, 1 - eps_lo, 1 + eps_hi) * a))
        start += n
    return -torch.stack(terms).mean()


def test_hand_worked_sequence_ratio_and_clipping():
    # One sequence of two tokens with log-ratios 0.2 and 0.4: s = exp(0.3) = 1.3499.
    logp = torch.tensor([0.2, 0.4], requires_grad=True)
    prox = torch.zeros(2)
    mask = torch.ones(2, dtype=torch.bool)
    # A = +1: clipped at 1 + 0.2 -> loss -1.2 on each token, no gradient.
    tok, stats = gspo_policy_loss(logp, prox, torch.ones(2), mask, eps_clip=0.2, eps_clip_high=0.2)
    assert tok.tolist() == pytest.approx([-1.2, -1.2])
    assert stats["clip_frac_high"].item() == 1.0 and stats["seq_ratio_max"].item() == pytest.approx(math.exp(0.3))
    aggregate_loss(tok, mask, "seq-mean-token-mean", torch.tensor([0, 2])).backward()
    assert logp.grad.tolist() == [0.0, 0.0]
    # A = -1: unclipped, loss s = 1.3499, d/dlogp_t of s = s / |y| = 0.675 for each token.
    logp.grad = None
    tok, _ = gspo_policy_loss(logp, prox, -torch.ones(2), mask, eps_clip=0.2, eps_clip_high=0.2)
    aggregate_loss(tok, mask, "seq-mean-token-mean", torch.tensor([0, 2])).backward()
    assert logp.grad.tolist() == pytest.approx([math.exp(0.3) / 2] * 2, rel=1e-5)


def _packed(seed=0, lengths=(5, 1, 0, 7, 3)):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths) + 2  # 2 trailing padding tokens
    prox = -torch.rand(T, generator=g) * 2
    logp = prox + torch.randn(T, generator=g) * 0.3
    seq_adv = torch.randn(len(lengths), generator=g)
    adv = torch.cat([seq_adv[i].repeat(n) for i, n in enumerate(lengths)] + [torch.zeros(2)])
    mask = torch.ones(T, dtype=torch.bool)
    mask[-2:] = False
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()])
    return logp, prox, adv, seq_adv, mask, cu, list(lengths)


@pytest.mark.parametrize("token_level", [False, True])
@pytest.mark.parametrize("eps", [(0.05, 0.08), (3e-4, 4e-4)])
def test_matches_the_paper_objective_in_value_and_gradient(token_level, eps):
    logp, prox, adv, seq_adv, mask, cu, lengths = _packed()
    lp1 = logp.clone().requires_grad_(True)
    tok, _ = gspo_policy_loss(lp1, prox, adv, mask, eps_clip=eps[0], eps_clip_high=eps[1],
                              token_level=token_level, cu_seqlens=cu)
    ours = aggregate_loss(tok, mask, "seq-mean-token-mean", cu)
    ours.backward()
    lp2 = logp.clone().requires_grad_(True)
    ref = paper_objective(lp2, prox, seq_adv, lengths, *eps)
    ref.backward()
    assert ours.item() == pytest.approx(ref.item(), abs=1e-6)
    assert torch.allclose(lp1.grad, lp2.grad, atol=1e-6)
    assert tok[~mask].abs().sum() == 0


def test_rows_layout_equals_packed_layout_and_all_masked_rows_are_zero():
    logp, prox, adv, _, mask, cu, lengths = _packed(seed=3, lengths=(4, 2, 3))
    B, L = len(lengths), max(lengths)
    rows = lambda x: torch.stack([torch.cat([x[cu[i]:cu[i + 1]], x.new_zeros(L - n)]) for i, n in enumerate(lengths)])
    rmask = torch.stack([torch.arange(L) < n for n in lengths])
    rmask_with_empty = torch.cat([rmask, torch.zeros(1, L, dtype=torch.bool)])
    pad = lambda x: torch.cat([rows(x), torch.full((1, L), 50.0)])  # garbage in the all-masked row
    tok_rows, _ = gspo_policy_loss(pad(logp), pad(prox), pad(adv), rmask_with_empty, eps_clip=0.1)
    tok_packed, _ = gspo_policy_loss(logp, prox, adv, mask, eps_clip=0.1, cu_seqlens=cu)
    assert torch.allclose(tok_rows[:B][rmask], tok_packed[mask], atol=1e-6)
    assert tok_rows[B].abs().sum() == 0 and torch.isfinite(tok_rows).all()


def test_gspo_token_differs_from_gspo_only_with_token_advantages():
    logp, prox, _, _, mask, cu, lengths = _packed(seed=1, lengths=(4, 6))
    adv = torch.linspace(-1, 1, logp.shape[0]) * mask
    grads = []
    for token_level in (False, True):
        lp = logp.clone().requires_grad_(True)
        tok, _ = gspo_policy_loss(lp, prox, adv, mask, eps_clip=0.5, token_level=token_level, cu_seqlens=cu)
        aggregate_loss(tok, mask, "seq-mean-token-mean", cu).backward()
        grads.append(lp.grad)
    assert not torch.allclose(grads[0], grads[1])
    # GSPO-token's gradient on token t (unclipped): -A_t * s_i / |y_i| / G (the seq mean over G = 2).
    s0 = torch.exp((logp[:4] - prox[:4]).mean())
    assert grads[1][:4].tolist() == pytest.approx((-adv[:4] * s0 / 4 / 2).tolist(), rel=1e-5)


def test_extreme_ratios_stay_finite_and_decoupled_weight_applies():
    logp = torch.tensor([80.0, 0.1, -90.0, 0.0], requires_grad=True)
    prox = torch.zeros(4)
    behav = torch.tensor([0.0, -0.1, 0.0, -3.0])  # last token: w = e^3 > cap -> dropped
    mask = torch.ones(4, dtype=torch.bool)
    cu = torch.tensor([0, 2, 4])
    tok, stats = gspo_policy_loss(logp, prox, torch.tensor([1.0, 1.0, -1.0, -1.0]), mask, eps_clip=0.2,
                                  cu_seqlens=cu, behav_logp=behav, behav_imp_weight_cap=5.0)
    tok.sum().backward()
    assert torch.isfinite(tok).all() and torch.isfinite(logp.grad).all()
    assert tok[3].item() == 0.0 and stats["imp_weight_capped_frac"].item() == 0.25


def test_registered_under_config_names_and_given_the_sequences():
    cfg = AlgorithmConfig(policy_loss="gspo", eps_clip=3e-4, eps_clip_high=4e-4, loss_agg_mode="seq-mean-token-mean")
    logp, prox, adv, _, mask, cu, _ = _packed()
    bound = bind_policy_loss(resolve_policy_loss(cfg.policy_loss), cfg)
    tok, _ = bound(logp, prox, adv, mask, None, cu_seqlens=cu)
    direct, _ = gspo_policy_loss(logp, prox, adv, mask, eps_clip=3e-4, eps_clip_high=4e-4, cu_seqlens=cu)
    assert torch.equal(tok, direct)
