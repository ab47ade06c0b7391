"""Token returns, GAE, global whitening and REINFORCE++ against hand-worked numbers and plain loops."""

from __future__ import annotations

import pytest
import torch

from arealite.algo.actor import PPOActor
from arealite.algo.advantage import group_advantages
from arealite.algo.returns import discounted_returns, gae, global_whiten, terminal_rewards
from arealite.config.schema import AlgorithmConfig
from tensordict import TensorDict


def make_batch(B: int, L: int, seed: int = 0) -> TensorDict:
    """Right-padded rows: a 2-token prompt, completions of ragged length, random rewards and log-probs."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, L + 1, (B,), generator=g)
    pos = torch.arange(L)[None, :]
    am = pos < lengths[:, None]
    lm = am & (pos >= 2)
    return TensorDict({
        "input_ids": torch.randint(5, 50, (B, L), generator=g) * am, "attention_mask": am, "loss_mask": lm,
        "logprobs": torch.where(lm, -torch.rand(B, L, generator=g), torch.zeros(())),
        "rewards": torch.rand(B, generator=g), "group_id": torch.arange(B) // 2,
    }, batch_size=[B])


def gae_loop(rewards, values, mask, gamma, lam):
    """GAE from its definition: A_t = sum_l (gamma lam)^l delta_{t+l} over each row's loss tokens."""
    adv = [[0.0] * len(r) for r in rewards]
    for b, (r, v, m) in enumerate(zip(rewards, values, mask)):
        steps = [t for t, k in enumerate(m) if k]
        vs = [v[t] for t in steps] + [0.0]
        deltas = [r[t] + gamma * vs[i + 1] - vs[i] for i, t in enumerate(steps)]
        for i, t in enumerate(steps):
            adv[b][t] = sum((gamma * lam) ** l * deltas[i + l] for l in range(len(steps) - i))
    return adv


def test_gae_hand_worked():
    # One row, 3 policy tokens after a prompt token, reward 1 at the end, V = [0.5, 0.6, 0.8].
    mask = torch.tensor([[False, True, True, True]])
    r = terminal_rewards(torch.tensor([1.0]), mask)
    assert r.tolist() == [[0.0, 0.0, 0.0, 1.0]]
    v = torch.tensor([[9.0, 0.5, 0.6, 0.8]])  # the prompt position's value is ignored
    adv, ret = gae(r, v, mask, gamma=1.0, lam=1.0)
    assert adv[0].tolist() == pytest.approx([0.0, 0.5, 0.4, 0.2])  # R - V(s_t)
    assert ret[0].tolist() == pytest.approx([0.0, 1.0, 1.0, 1.0])
    adv0, _ = gae(r, v, mask, gamma=1.0, lam=0.0)  # one-step TD errors
    assert adv0[0].tolist() == pytest.approx([0.0, 0.1, 0.2, 0.2])
    adv_g, _ = gae(r, v, mask, gamma=0.5, lam=1.0)  # discounted MC: 0.25, 0.5, 1 minus V
    assert adv_g[0].tolist() == pytest.approx([0.0, 0.25 - 0.5, 0.5 - 0.6, 1.0 - 0.8])


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (1.0, 0.5)])
def test_gae_matches_the_definition_on_ragged_masks(gamma, lam):
    g = torch.Generator().manual_seed(0)
    B, L = 5, 9
    mask = torch.rand(B, L, generator=g) > 0.35  # gaps: multi-turn tool output inside a row
    mask[2] = False  # an all-masked row
    mask[3] = False
    mask[3, 4] = True  # a one-token row
    r = torch.randn(B, L, generator=g) * mask
    v = torch.randn(B, L, generator=g)
    adv, ret = gae(r, v, mask, gamma, lam)
    want = torch.tensor(gae_loop(r.tolist(), v.tolist(), mask.tolist(), gamma, lam))
    assert torch.allclose(adv, want, atol=1e-5)
    assert torch.allclose(ret, torch.where(mask, adv + v, torch.zeros(())), atol=1e-6)
    assert adv[2].abs().sum() == 0


def test_discounted_returns_and_kl_in_reward():
    mask = torch.tensor([[False, True, True, False, True], [True, False, False, False, False]])
    r = torch.tensor([[5.0, 1.0, 2.0, 7.0, 3.0], [4.0, 0, 0, 0, 0]])
    out = discounted_returns(r, mask, gamma=0.5)
    want = torch.tensor([[0.0, 1 + 0.5 * 2 + 0.25 * 3, 2 + 0.5 * 3, 0.0, 3.0], [4.0, 0, 0, 0, 0]])
    assert torch.allclose(out, want)


def test_global_whiten_equals_the_plain_formula_and_handles_degenerate_cases():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 6.0]])
    mask = torch.tensor([[True, True, True], [True, False, True]])
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0, 6.0])
    want = (vals - vals.mean()) / (vals.std() + 1e-6)
    got = global_whiten(x, mask)
    assert got[mask].tolist() == pytest.approx(want.tolist(), rel=1e-6)
    assert got[1, 1] == 0
    assert global_whiten(torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool)).abs().sum() == 0
    assert global_whiten(x, torch.zeros_like(mask)).abs().sum() == 0


def test_reinforce_pp_baseline_is_the_group_centred_reward_even_for_groups_of_one():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5])
    gid = torch.tensor([7, 7, 7, 3])
    adv = group_advantages(rewards, gid, "reinforce_pp_baseline")
    assert adv.tolist() == pytest.approx([1 / 3, -2 / 3, 1 / 3, 0.0])
    assert group_advantages(rewards, gid, "reinforce_pp").tolist() == rewards.tolist()


def test_reinforce_pp_actor_kl_in_reward_then_global_whitening():
    """A_t = whiten(R at the last token + sum_{s>=t} -beta * KL_s), written out from the paper."""
    batch = make_batch(B=4, L=8, seed=2)
    batch["ref_logp"] = batch["logprobs"] - 0.1 * torch.arange(8.0)[None, :] * batch["loss_mask"]
    cfg = AlgorithmConfig(adv_estimator="reinforce_pp", adv_norm="batch", kl_coef=0.5, kl_in_reward=True,
                          kl_estimator="k1")
    PPOActor(cfg, None, 1.0).compute_advantages(batch)  # type: ignore[arg-type]
    mask = batch["loss_mask"].bool()
    raw = torch.zeros(4, 8)
    for b in range(4):
        steps = [t for t in range(8) if mask[b, t]]
        for i, t in enumerate(steps):
            later = steps[i:]
            kl = sum(float(batch["logprobs"][b, s] - batch["ref_logp"][b, s]) for s in later)
            raw[b, t] = float(batch["rewards"][b]) - 0.5 * kl
    vals = raw[mask]
    want = (vals - vals.mean()) / (vals.std() + 1e-6)
    assert batch["advantages"][mask].tolist() == pytest.approx(want.tolist(), rel=1e-4, abs=1e-5)
    # With the KL in the reward, the loss carries no KL term.
    assert PPOActor(cfg, None, 1.0).loss_fn().keywords["kl_coef"] == 0.0  # type: ignore[arg-type]


def test_reinforce_pp_needs_global_normalisation_and_kl_in_reward_needs_a_coefficient():
    with pytest.raises(ValueError, match="algorithm.adv_norm.*batch"):
        PPOActor(AlgorithmConfig(adv_estimator="reinforce_pp"), None, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="algorithm.kl_in_reward.*kl_coef > 0"):
        PPOActor(AlgorithmConfig(kl_in_reward=True), None, 1.0)  # type: ignore[arg-type]


def test_gae_in_the_actor_needs_values_and_adds_returns():
    batch = make_batch(B=3, L=6, seed=4)
    actor = PPOActor(AlgorithmConfig(adv_estimator="gae", gamma=1.0, gae_lambda=1.0), None, 1.0)  # type: ignore
    with pytest.raises(KeyError, match="values"):
        actor.compute_advantages(batch)
    batch["values"] = torch.full((3, 6), 0.25)
    actor.compute_advantages(batch)
    mask = batch["loss_mask"].bool()
    want = (batch["rewards"][:, None] - 0.25).expand(3, 6)[mask]
    assert batch["advantages"][mask].tolist() == pytest.approx(want.tolist())
    assert batch["returns"][mask].tolist() == pytest.approx(batch["rewards"][:, None].expand(3, 6)[mask].tolist())
