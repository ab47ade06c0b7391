"""TIS / MIS mismatch weights: hand-worked numbers, a per-token loop from the definitions, and the PPO loss."""

from __future__ import annotations

import math

import pytest
import torch

from arealite.algo.loss import ppo_actor_loss, ppo_policy_loss
from arealite.algo.mismatch import mismatch_weights
from arealite.config.schema import AlgorithmConfig, MismatchConfig
from arealite.train_engine.lm_head import ChunkedHead


def reference(prox, behav, mask, mode, level, upper, lower, lengths):
    """Plain-Python weights and keep flags, one sequence after another (rows of a packed tensor)."""
    lo = 0.0 if lower is None else lower
    weights, keeps, start = [], [], 0
    for n in lengths:
        lw = [prox[start + j] - behav[start + j] for j in range(n)]
        m = [bool(mask[start + j]) for j in range(n)]
        if level == "sequence":
            inside = [x for x, k in zip(lw, m) if k]
            g = math.exp(sum(inside) / len(inside)) if inside else 1.0
            ws = [g] * n
        else:
            ws = [math.exp(x) for x in lw]
        for w, k in zip(ws, m):
            if not k:
                weights.append(0.0), keeps.append(False)
            elif mode == "tis":
                weights.append(min(max(w, lo), upper)), keeps.append(True)
            elif lo <= w <= upper:
                weights.append(w), keeps.append(True)
            else:
                weights.append(0.0), keeps.append(False)
        start += n
    return weights, keeps


def test_hand_worked_token_tis_and_mis():
    prox = torch.tensor([0.0, 0.0, 0.0, 0.0])
    behav = torch.tensor([0.0, -1.0, 1.0, -0.5])  # w = 1, e, 1/e, e^0.5
    mask = torch.tensor([True, True, True, False])
    tis = mismatch_weights(prox, behav, mask, "tis", "token", upper=2.0)
    assert tis.weight.tolist() == pytest.approx([1.0, 2.0, math.exp(-1), 0.0])
    assert tis.stats["mismatch_truncated_frac"].item() == pytest.approx(1 / 3)
    assert tis.stats["mismatch_ratio_max"].item() == pytest.approx(math.e)
    two = mismatch_weights(prox, behav, mask, "tis", "token", upper=2.0, lower=0.5)
    assert two.weight.tolist() == pytest.approx([1.0, 2.0, 0.5, 0.0])
    mis = mismatch_weights(prox, behav, mask, "mis", "token", upper=2.0, lower=0.5)
    assert mis.keep.tolist() == [True, False, False, False]
    assert mis.stats["mismatch_masked_frac"].item() == pytest.approx(2 / 3)
    # k3 of KL(mu || pi): mean of w - 1 - log w over the loss tokens.
    k3 = [(w - 1 - math.log(w)) for w in (1.0, math.e, math.exp(-1))]
    assert tis.stats["mismatch_kl_k3"].item() == pytest.approx(sum(k3) / 3, rel=1e-6)


@pytest.mark.parametrize("mode", ["tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("lower", [None, 0.6])
def test_matches_the_definition_on_ragged_packed_sequences(mode, level, lower):
    g = torch.Generator().manual_seed(0)
    lengths = [6, 1, 4, 3, 5]
    T = sum(lengths)
    prox = -torch.rand(T, generator=g) * 2
    behav = prox + torch.randn(T, generator=g) * 0.5
    mask = torch.rand(T, generator=g) > 0.25
    mask[6] = False  # the one-token sequence is all-masked
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()])
    got = mismatch_weights(prox, behav, mask, mode, level, upper=1.5, lower=lower, cu_seqlens=cu)
    want_w, want_keep = reference(prox.tolist(), behav.tolist(), mask.tolist(), mode, level, 1.5, lower, lengths)
    assert got.weight.tolist() == pytest.approx(want_w, rel=1e-5)
    assert got.keep.tolist() == want_keep
    # [B, L] rows give the same weights as the packed layout.
    L = max(lengths)
    rows = lambda x, fill: torch.stack([torch.cat([x[cu[i]:cu[i + 1]], x.new_full((L - n,), fill)])
                                        for i, n in enumerate(lengths)])
    got_rows = mismatch_weights(rows(prox, 0), rows(behav, -900), rows(mask, False), mode, level, 1.5, lower)
    assert got_rows.weight[rows(mask, False)].tolist() == pytest.approx(got.weight[mask].tolist(), rel=1e-6)


def test_extreme_log_ratios_do_not_overflow():
    prox = torch.tensor([0.0, 0.0])
    behav = torch.tensor([-500.0, 500.0])
    w = mismatch_weights(prox, behav, torch.ones(2, dtype=torch.bool), "tis", "token", upper=3.0)
    assert w.weight.tolist() == pytest.approx([3.0, math.exp(-20)])
    assert torch.isfinite(w.stats["mismatch_kl_k3"]) and torch.isfinite(w.stats["mismatch_ratio_max"])


def test_bad_bounds_fail_clearly():
    t = torch.zeros(2)
    with pytest.raises(ValueError, match="upper bound.*> 1"):
        mismatch_weights(t, t, t.bool(), "tis", "token", upper=0.9)
    with pytest.raises(ValueError, match=r"lower bound.*\[0, 1\)"):
        mismatch_weights(t, t, t.bool(), "mis", "token", upper=2.0, lower=1.2)
    with pytest.raises(ValueError, match="use_decoupled_loss"):
        from arealite.algo.actor import PPOActor

        PPOActor(AlgorithmConfig(use_decoupled_loss=False, mismatch=MismatchConfig(mode="tis")), None, 1.0)


def test_the_ppo_loss_uses_the_tis_weight_and_logs_the_stats():
    g = torch.Generator().manual_seed(1)
    T = 12
    prox = -torch.rand(T, generator=g)
    behav = prox + torch.randn(T, generator=g)
    logp = (prox + 0.05 * torch.randn(T, generator=g)).requires_grad_(True)
    adv = torch.randn(T, generator=g)
    mask = torch.ones(T, dtype=torch.bool)
    spec = MismatchConfig(mode="tis", upper=1.5)
    tok, stats = ppo_policy_loss(logp, prox, adv, mask, behav_logp=behav, behav_imp_weight_cap=None, mismatch=spec)
    plain, _ = ppo_policy_loss(logp, prox, adv, mask, behav_logp=None)
    w = torch.exp(prox - behav).clamp(max=1.5)
    assert torch.allclose(tok, plain * w, atol=1e-6)
    assert {"mismatch_kl_k3", "mismatch_ratio_max", "mismatch_truncated_frac"} <= set(stats)
    # Through the engine-facing loss: the stats land in mb["_stats"] every micro-batch.
    logits = torch.randn(T, 7)
    labels = torch.randint(0, 7, (T,))
    mb = {"labels": labels, "loss_mask": mask, "logprobs": behav, "advantages": adv,
          "cu_seqlens": torch.tensor([0, 5, T])}
    ppo_actor_loss(ChunkedHead.from_logits(logits), mb, temperature=1.0, prox_from_forward=True)
    assert "mismatch_kl_k3" in mb["_stats"] and mb["_stats"]["mismatch_kl_k3"] >= 0
