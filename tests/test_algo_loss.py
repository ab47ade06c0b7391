"""PPO loss, KL estimators and aggregation against plain per-token loops."""

from __future__ import annotations

import math

import pytest
import torch

from arealite.algo.loss import aggregate_loss, kl_penalty, loss_weight, ppo_actor_loss, ppo_policy_loss
from arealite.train_engine.lm_head import ChunkedHead


def ref_token_loss(lp, px, a, eps_lo, eps_hi, c_clip=None, bh=None, cap=None):
    """One token of the (decoupled, dual-clipped) PPO loss, in plain floats; None = masked out."""
    ratio = math.exp(lp - px)
    loss = max(-a * ratio, -a * min(max(ratio, 1 - eps_lo), 1 + eps_hi))
    if c_clip is not None and a < 0:
        loss = min(loss, -a * c_clip)
    if bh is not None:
        w = math.exp(px - bh)
        if cap is not None and w > cap:
            return None
        loss *= w
    return loss


def _tensors(B=6, L=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    behav = -torch.rand(B, L, generator=g) * 3
    prox = behav + torch.randn(B, L, generator=g) * 0.8  # wide spread: some weights exceed the cap
    logp = prox + torch.randn(B, L, generator=g) * 0.7  # wide spread: clipping is active
    adv = torch.randn(B, L, generator=g) * 2
    mask = torch.rand(B, L, generator=g) > 0.3
    mask[1] = False  # an all-masked row
    # Garbage outside the mask must not matter (nor overflow exp).
    logp = torch.where(mask, logp, torch.full_like(logp, 500.0))
    behav = torch.where(mask, behav, torch.full_like(behav, -800.0))
    return logp, prox, behav, adv, mask


CASES = [
    dict(eps_clip=0.2),
    dict(eps_clip=0.2, eps_clip_high=0.28),
    dict(eps_clip=0.1, c_clip=2.0),
    dict(eps_clip=0.2, decoupled=True, cap=None),
    dict(eps_clip=0.2, eps_clip_high=0.3, c_clip=1.5, decoupled=True, cap=2.0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_policy_loss_matches_loop(case):
    logp, prox, behav, adv, mask = _tensors()
    logp = logp.clone().requires_grad_(True)
    eps_hi = case.get("eps_clip_high") or case["eps_clip"]
    decoupled = case.get("decoupled", False)
    tok, stats = ppo_policy_loss(
        logp, prox, adv, mask, eps_clip=case["eps_clip"], eps_clip_high=case.get("eps_clip_high"),
        c_clip=case.get("c_clip"), behav_logp=behav if decoupled else None,
        behav_imp_weight_cap=case.get("cap"),
    )
    n_low = n_high = n_dual = n_capped = n = 0
    kept = []
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[b, t]:
                assert tok[b, t] == 0
                continue
            n += 1
            lp, px, a = float(logp[b, t].detach()), float(prox[b, t]), float(adv[b, t])
            want = ref_token_loss(lp, px, a, case["eps_clip"], eps_hi, case.get("c_clip"),
                                  float(behav[b, t]) if decoupled else None, case.get("cap"))
            if want is None:
                n_capped += 1
                assert tok[b, t] == 0
                continue
            kept.append((b, t))
            assert math.isclose(float(tok[b, t].detach()), want, rel_tol=1e-5, abs_tol=1e-6), (b, t)
            r = math.exp(lp - px)
            n_low += (a < 0 and r < 1 - case["eps_clip"])
            n_high += (a > 0 and r > 1 + eps_hi)
            c = case.get("c_clip")
            n_dual += bool(c is not None and a < 0 and a * r * -1 > -a * c)
    assert math.isclose(float(stats["clip_frac_low"]), n_low / n, abs_tol=1e-6)
    assert math.isclose(float(stats["clip_frac_high"]), n_high / n, abs_tol=1e-6)
    assert math.isclose(float(stats["clip_frac_dual"]), n_dual / n, abs_tol=1e-6)
    if case.get("c_clip"):
        assert n_dual > 0, "the random data should exercise the dual clip"
    assert n_low + n_high > 0, "the random data should exercise clipping"
    if decoupled:
        ws = [math.exp(float(prox[b, t] - behav[b, t])) for b in range(6) for t in range(12) if mask[b, t]]
        assert math.isclose(float(stats["imp_weight_mean"]), sum(ws) / n, rel_tol=1e-5)
        assert math.isclose(float(stats["imp_weight_max"]), max(ws), rel_tol=1e-5)
        assert math.isclose(float(stats["imp_weight_capped_frac"]), n_capped / n, abs_tol=1e-6)
        if case.get("cap"):
            assert n_capped > 0, "the random data should exercise the cap"

    # Gradients: finite everywhere, zero off the mask, on capped and on clipped tokens.
    tok.sum().backward()
    assert torch.isfinite(logp.grad).all()
    assert (logp.grad[~mask] == 0).all()
    for b in range(6):
        for t in range(12):
            if mask[b, t] and (b, t) not in kept:
                assert logp.grad[b, t] == 0
            if (b, t) in kept:
                r = math.exp(float(logp[b, t].detach() - prox[b, t]))
                a = float(adv[b, t])
                if (a > 0 and r > 1 + eps_hi) or (a < 0 and r < 1 - case["eps_clip"]):
                    assert logp.grad[b, t] == 0


def test_policy_loss_rejects_bad_constants():
    logp, prox, behav, adv, mask = _tensors()
    with pytest.raises(ValueError, match="c_clip"):
        ppo_policy_loss(logp, prox, adv, mask, c_clip=0.9)
    with pytest.raises(ValueError, match="eps_clip_high"):
        ppo_policy_loss(logp, prox, adv, mask, eps_clip_high=-0.1)
    with pytest.raises(ValueError, match="one shape"):
        ppo_policy_loss(logp[:, :3], prox, adv, mask)


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators_per_token(est):
    g = torch.Generator().manual_seed(3)
    logp, ref = -torch.rand(40, generator=g) * 4, -torch.rand(40, generator=g) * 4
    got = kl_penalty(logp, ref, est)
    for x, r, k in zip(logp.tolist(), ref.tolist(), got.tolist()):
        d = x - r
        want = {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) - 1 + d}[est]
        assert math.isclose(k, want, rel_tol=1e-5, abs_tol=1e-6)
    if est in ("k2", "k3"):
        assert (got >= 0).all()
    assert kl_penalty(logp, ref, est, mask=torch.zeros(40, dtype=torch.bool)).abs().sum() == 0


def test_kl_estimators_are_unbiased_on_a_categorical():
    # Tokens sampled from the policy: E[k1] = E[k3] = KL(policy || ref).
    policy = torch.tensor([0.5, 0.3, 0.15, 0.05])
    ref = torch.tensor([0.25, 0.25, 0.25, 0.25])
    true_kl = float((policy * (policy / ref).log()).sum())
    tokens = torch.multinomial(policy, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    lp, rp = policy.log()[tokens], ref.log()[tokens]
    for est in ("k1", "k3"):
        assert abs(float(kl_penalty(lp, rp, est).mean()) - true_kl) < 0.01, est
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(lp, rp, "k4")


def ref_aggregate(values, mask, mode, const):
    """values/mask: lists of rows (sequences)."""
    if mode == "token-mean":
        toks = [v for row, m in zip(values, mask) for v, k in zip(row, m) if k]
        return sum(toks) / len(toks) if toks else 0.0
    per_seq = []
    for row, m in zip(values, mask):
        toks = [v for v, k in zip(row, m) if k]
        if toks:
            per_seq.append(sum(toks) / (len(toks) if mode == "seq-mean-token-mean" else const))
    return sum(per_seq) / len(per_seq) if per_seq else 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregation_rows_and_packed_agree_with_loop(mode):
    g = torch.Generator().manual_seed(4)
    lengths = [5, 1, 7, 3, 4]
    seqs = [torch.randn(n, generator=g) for n in lengths]
    masks = [torch.rand(n, generator=g) > 0.3 for n in lengths]
    masks[3][:] = False  # a sequence without loss tokens
    ref = ref_aggregate([s.tolist() for s in seqs], [m.tolist() for m in masks], mode, 16.0)
    # Packed layout [T] + cu_seqlens.
    vals, msk = torch.cat(seqs), torch.cat(masks)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    got_packed = aggregate_loss(vals, msk, mode, cu, 16.0)
    # Row layout [B, L], right-padded with garbage.
    L = max(lengths)
    rows = torch.full((5, L), 1e6)
    rmask = torch.zeros(5, L, dtype=torch.bool)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        rows[i, : len(s)], rmask[i, : len(s)] = s, m
    got_rows = aggregate_loss(rows, rmask, mode, agg_constant=16.0)
    assert math.isclose(float(got_packed), ref, rel_tol=1e-5, abs_tol=1e-6)
    assert math.isclose(float(got_rows), ref, rel_tol=1e-5, abs_tol=1e-6)
    n_units = sum(int(m.sum()) for m in masks) if mode == "token-mean" else sum(bool(m.any()) for m in masks)
    assert loss_weight(msk, mode, cu) == n_units
    assert loss_weight(rmask, mode) == n_units


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_all_masked_gives_zero_not_nan(mode):
    x = torch.randn(6, requires_grad=True)
    out = aggregate_loss(x, torch.zeros(6, dtype=torch.bool), mode, torch.tensor([0, 2, 6]), 4.0)
    out.backward()
    assert float(out.detach()) == 0.0 and torch.isfinite(x.grad).all() and (x.grad == 0).all()


def test_aggregation_bad_input():
    x, m = torch.randn(6), torch.ones(6, dtype=torch.bool)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate_loss(x, m, "sum")
    with pytest.raises(ValueError, match="loss_agg_constant"):
        aggregate_loss(x, m, "seq-mean-token-sum", torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        aggregate_loss(x, m, "seq-mean-token-mean")
    with pytest.raises(ValueError, match="cu_seqlens"):
        aggregate_loss(x, m, "seq-mean-token-mean", torch.tensor([0, 4, 2]))


def _mb(seed=0, V=11):
    g = torch.Generator().manual_seed(seed)
    lengths = [4, 6, 3]
    T = sum(lengths)
    mask = torch.rand(T, generator=g) > 0.25
    cu = torch.tensor([0, 4, 10, 13], dtype=torch.int32)
    for end in cu[1:]:
        mask[end - 1] = False  # the engine's contract: no loss on each sequence's last position
    return {
        "labels": torch.randint(0, V, (T,), generator=g),
        "loss_mask": mask,
        "logprobs": -torch.rand(T, generator=g) * 3,
        "prox_logp": -torch.rand(T, generator=g) * 3,
        "ref_logp": -torch.rand(T, generator=g) * 3,
        "advantages": torch.randn(T, generator=g),
        "cu_seqlens": cu,
    }, torch.randn(T, V, generator=g)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("kl_est", ["k1", "k3"])
def test_ppo_actor_loss_composes_the_pieces(mode, kl_est):
    mb, logits = _mb()
    T_ = 0.9
    kw = dict(eps_clip=0.2, eps_clip_high=0.25, c_clip=3.0, behav_imp_weight_cap=4.0)
    head = ChunkedHead.from_logits(logits)
    loss = ppo_actor_loss(head, mb, temperature=T_, kl_coef=0.1, kl_estimator=kl_est, entropy_coef=0.01,
                          loss_agg_mode=mode, agg_constant=8.0, use_decoupled_loss=True, **kw)
    # Recompute token by token.
    logp_all = torch.log_softmax(logits / T_, -1)
    cu = mb["cu_seqlens"].tolist()
    values, masks = [], []
    for s in range(3):
        row, mrow = [], []
        for t in range(cu[s], cu[s + 1]):
            m = bool(mb["loss_mask"][t])
            lp = float(logp_all[t, mb["labels"][t]])
            ent = float(-(logp_all[t].exp() * logp_all[t]).sum())
            v = ref_token_loss(lp, float(mb["prox_logp"][t]), float(mb["advantages"][t]), 0.2, 0.25, 3.0,
                               float(mb["logprobs"][t]), 4.0)
            d = lp - float(mb["ref_logp"][t])
            kl = d if kl_est == "k1" else math.exp(-d) - 1 + d
            row.append((0.0 if v is None else v) + 0.1 * kl - 0.01 * ent)
            mrow.append(m)
        values.append(row)
        masks.append(mrow)
    assert math.isclose(float(loss), ref_aggregate(values, masks, mode, 8.0), rel_tol=1e-5, abs_tol=1e-6)
    stats = mb["_stats"]
    for key in ("clip_frac_low", "clip_frac_high", "clip_frac_dual", "imp_weight_mean", "imp_weight_max",
                "approx_kl_behav", "approx_kl_prox", "entropy", "kl_ref", "logp_mismatch_mean",
                "logp_mismatch_max", "pg_loss"):
        assert isinstance(stats[key], float), key
    m = mb["loss_mask"]
    delta = (mb["prox_logp"] - mb["logprobs"]).abs()[m]
    assert math.isclose(stats["logp_mismatch_mean"], float(delta.mean()), rel_tol=1e-5)
    assert math.isclose(stats["logp_mismatch_max"], float(delta.max()), rel_tol=1e-5)


def test_ppo_actor_loss_without_prox_uses_behaviour_and_no_weight():
    mb, logits = _mb(seed=1)
    del mb["prox_logp"]
    loss = ppo_actor_loss(ChunkedHead.from_logits(logits), mb, temperature=1.0, behav_imp_weight_cap=1.01)
    logp = torch.log_softmax(logits, -1).gather(-1, mb["labels"][:, None]).squeeze(-1)
    tok, _ = ppo_policy_loss(logp, mb["logprobs"], mb["advantages"], mb["loss_mask"])
    assert math.isclose(float(loss), float(tok[mb["loss_mask"]].mean()), rel_tol=1e-5, abs_tol=1e-6)
    assert "imp_weight_mean" not in mb["_stats"] and "logp_mismatch_mean" not in mb["_stats"]
    ent = -(torch.log_softmax(logits, -1).exp() * torch.log_softmax(logits, -1)).sum(-1)
    assert math.isclose(mb["_stats"]["entropy"], float(ent[mb["loss_mask"]].mean()), rel_tol=1e-5)


def test_ppo_actor_loss_needs_ref_for_kl():
    mb, logits = _mb()
    del mb["ref_logp"]
    with pytest.raises(KeyError, match="ref_logp"):
        ppo_actor_loss(ChunkedHead.from_logits(logits), mb, temperature=1.0, kl_coef=0.1)
    del mb["advantages"]
    with pytest.raises(KeyError, match="compute_advantages"):
        ppo_actor_loss(ChunkedHead.from_logits(logits), mb, temperature=1.0)
