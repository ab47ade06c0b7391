"""No NaN gradient from an overflowing log-ratio nor from -inf logits in the entropy term."""

from __future__ import annotations

import torch

from arealite.algo.logprob import gather_logprobs_entropy, token_entropy
from arealite.algo.loss import ppo_actor_loss, ppo_policy_loss
from arealite.algo.ratio import clamped_exp
from arealite.train_engine.lm_head import ChunkedHead


def test_a_log_ratio_that_overflows_float32_gives_a_finite_loss_and_gradient():
    # exp(100) is inf in float32; the clipped branch is taken, and without the clamp the
    # backward would compute 0 * inf = NaN.
    logp = torch.tensor([100.0, -100.0, 0.1, 0.0], requires_grad=True)
    prox = torch.zeros(4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    mask = torch.ones(4, dtype=torch.bool)
    for c_clip in (None, 3.0):
        logp.grad = None
        tok, stats = ppo_policy_loss(logp, prox, adv, mask, eps_clip=0.2, c_clip=c_clip)
        tok.sum().backward()
        assert torch.isfinite(tok).all() and torch.isfinite(logp.grad).all(), c_clip
        assert all(torch.isfinite(v) for v in stats.values())
    assert torch.isfinite(clamped_exp(torch.tensor(1e6))) and clamped_exp(torch.tensor(-1e6)) > 0


def test_decoupled_weight_with_an_overflowing_log_ratio_and_no_cap_is_finite():
    logp = torch.tensor([0.0, 0.0], requires_grad=True)
    tok, _ = ppo_policy_loss(logp, torch.zeros(2), torch.ones(2), torch.ones(2, dtype=torch.bool),
                             behav_logp=torch.tensor([-300.0, 0.0]), behav_imp_weight_cap=None)
    tok.sum().backward()
    assert torch.isfinite(tok).all() and torch.isfinite(logp.grad).all()


def test_entropy_with_minus_inf_logits_has_no_nan_gradient():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 9, generator=g)
    logits[:, 6:] = -float("inf")  # a masked part of the vocabulary
    logits.requires_grad_(True)
    labels = torch.randint(0, 6, (5,), generator=g)
    logp, ent = gather_logprobs_entropy(logits, labels)
    (ent.sum() - logp.sum()).backward()
    assert torch.isfinite(ent).all() and torch.isfinite(logits.grad).all()
    assert (logits.grad[:, 6:] == 0).all()
    # Same value as the entropy of the unmasked part alone.
    want = torch.distributions.Categorical(logits=logits.detach()[:, :6]).entropy()
    assert torch.allclose(ent, want, atol=1e-6)
    assert torch.allclose(token_entropy(logits.detach()), want, atol=1e-6)


def test_entropy_bonus_in_the_actor_loss_with_masked_vocabulary_is_finite():
    logits = torch.randn(6, 8)
    logits[:, 5:] = -float("inf")
    logits.requires_grad_(True)
    mb = {"labels": torch.randint(0, 5, (6,)), "loss_mask": torch.ones(6, dtype=torch.bool),
          "logprobs": torch.zeros(6), "advantages": torch.randn(6)}
    head = ChunkedHead.from_logits(logits)
    loss = ppo_actor_loss(head, mb, temperature=1.0, entropy_coef=0.01, prox_from_forward=True)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()
