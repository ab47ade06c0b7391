"""The critic's clipped value loss and explained variance."""

from __future__ import annotations

import pytest
import torch

from arealite.algo.value import explained_variance, value_hook, value_loss
from arealite.train_engine.lm_head import ChunkedHead


def test_clipped_value_loss_hand_worked():
    old = torch.tensor([0.0, 0.0, 0.0])
    ret = torch.tensor([1.0, 1.0, -1.0])
    new = torch.tensor([0.5, 0.1, 0.5], requires_grad=True)
    mask = torch.tensor([True, True, True])
    tok, stats = value_loss(new, old, ret, mask, value_clip=0.2)
    # token 0: clipped value 0.2 -> max(0.25, 0.64) / 2 = 0.32 (clip active, no gradient);
    # token 1: inside the range -> 0.81 / 2; token 2: clipped 0.2 -> max(2.25, 1.44) / 2 = 1.125.
    assert tok.tolist() == pytest.approx([0.32, 0.405, 1.125])
    assert stats["value_clip_frac"].item() == pytest.approx(1 / 3)
    tok.sum().backward()
    assert new.grad.tolist() == pytest.approx([0.0, 0.1 - 1.0, 0.5 + 1.0])


def test_value_loss_matches_the_formula_on_random_ragged_data_and_ignores_masked_garbage():
    g = torch.Generator().manual_seed(0)
    new = torch.randn(4, 6, generator=g)
    old = new + 0.3 * torch.randn(4, 6, generator=g)
    ret = torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.3
    mask[2] = False
    ret = torch.where(mask, ret, torch.full_like(ret, 1e30))
    tok, _ = value_loss(new, old, ret, mask, value_clip=0.1)
    v_clip = old + (new - old).clamp(-0.1, 0.1)
    want = 0.5 * torch.maximum((new - ret) ** 2, (v_clip - ret) ** 2)
    assert torch.allclose(tok[mask], want[mask]) and tok[~mask].abs().sum() == 0
    plain, _ = value_loss(new, old, ret, mask, value_clip=None)
    assert torch.allclose(plain[mask], 0.5 * (new - ret)[mask] ** 2)


def test_explained_variance():
    ret = torch.tensor([1.0, 2.0, 3.0, 4.0])
    mask = torch.ones(4, dtype=torch.bool)
    assert explained_variance(ret, ret, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full((4,), 2.5), ret, mask) == pytest.approx(0.0)
    # Residuals 0.5, -0.5, 0.5, -0.5: Var 0.25 against Var(ret) = 1.25.
    assert explained_variance(ret + torch.tensor([-0.5, 0.5, -0.5, 0.5]), ret, mask) == pytest.approx(0.8)
    assert explained_variance(ret, torch.ones(4), mask) == 0.0  # constant returns


def test_value_hook_takes_the_scalar_head():
    assert value_hook(ChunkedHead.from_logits(torch.tensor([[1.0], [2.0]])), {}).tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match=r"\[T, 1\]"):
        value_hook(ChunkedHead.from_logits(torch.zeros(2, 3)), {})
