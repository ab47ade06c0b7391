"""Rewards and advantages against plain loop computations written here."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from arealite.algo.advantage import (
    broadcast_to_tokens,
    group_advantages,
    normalize_advantages,
    stepwise_advantages,
    transform_rewards,
)

EPS = 1e-6


def ref_group_adv(rewards: list[float], groups: list[int], estimator: str) -> list[float]:
    out = []
    for i, r in enumerate(rewards):
        mates = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        if estimator == "none":
            out.append(r)
            continue
        if len(mates) == 1 or max(mates) == min(mates):
            out.append(0.0)
            continue
        mean = sum(mates) / len(mates)
        if estimator == "grpo":
            out.append((r - mean) / (statistics.stdev(mates) + EPS))
        elif estimator == "drgrpo":
            out.append(r - mean)
        else:  # rloo: minus the mean of the others
            others = list(mates)
            others.remove(r)
            out.append(r - sum(others) / len(others))
    return out


def _random_batch(seed: int, B: int = 23):
    g = torch.Generator().manual_seed(seed)
    # Non-contiguous, sparse group ids; some groups of one, some with equal rewards.
    groups = torch.tensor([7, 3, 7, 100, 3, 7, 42, 3, 9, 9, 9, 55] + [11, 12] * 5 + [13])[:B]
    rewards = torch.randint(0, 3, (B,), generator=g).float() + torch.rand(B, generator=g).round()
    rewards[groups == 9] = 0.5  # a group with equal rewards
    return rewards, groups


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo", "none"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_advantages_match_loops(estimator, seed):
    rewards, groups = _random_batch(seed)
    got = group_advantages(rewards, groups, estimator)
    ref = ref_group_adv(rewards.tolist(), groups.tolist(), estimator)
    assert not torch.isnan(got).any()
    for g_, r_ in zip(got.tolist(), ref):
        assert math.isclose(g_, r_, rel_tol=1e-5, abs_tol=1e-5)


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_single_sample_and_equal_rewards_give_exact_zero(estimator):
    # 0.1 * 3 is not exact in binary: the mean must not leave crumbs that eps would blow up.
    rewards = torch.tensor([0.1, 0.1, 0.1, 5.0, 0.3, 0.3])
    groups = torch.tensor([1, 1, 1, 2, 3, 3])
    got = group_advantages(rewards, groups, estimator)
    assert got.tolist() == [0.0] * 6


def test_group_advantage_properties():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    grpo = group_advantages(rewards, groups, "grpo")
    # Within a group GRPO advantages sum to 0 and have (Bessel) std ~ 1.
    assert abs(float(grpo[:4].sum())) < 1e-5
    assert abs(float(grpo[:4].std()) - 1.0) < 1e-4
    rloo = group_advantages(rewards, groups, "rloo")
    assert math.isclose(float(rloo[0]), 1.0, rel_tol=1e-6)  # 1 - mean(0, 0, 0)
    assert math.isclose(float(rloo[4]), -2.0, rel_tol=1e-6)


def test_group_advantage_bad_input():
    with pytest.raises(ValueError, match="group_id"):
        group_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="estimator"):
        group_advantages(torch.zeros(3), torch.zeros(3, dtype=torch.long), "ppo")
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([0.0, float("nan")]), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("scale,bias,clip", [(1.0, 0.0, None), (2.0, -0.5, None), (3.0, 0.25, 1.5), (-1.0, 1.0, 0.5)])
def test_transform_rewards(scale, bias, clip):
    rewards = torch.tensor([-2.0, -0.3, 0.0, 0.4, 1.0, 3.0])
    got = transform_rewards(rewards, scale, bias, clip)
    for r, g_ in zip(rewards.tolist(), got.tolist()):
        v = (r + bias) * scale
        if clip is not None:
            v = max(-clip, min(clip, v))
        assert math.isclose(g_, v, rel_tol=1e-6, abs_tol=1e-7)
    with pytest.raises(ValueError, match="clip"):
        transform_rewards(rewards, clip=-1.0)


def ref_stepwise(rewards, groups, trajs, steps, estimator, divide):
    runs = sorted(set(trajs))
    final = {}
    for t in runs:
        rows = [i for i in range(len(trajs)) if trajs[i] == t]
        final[t] = max(rows, key=lambda i: steps[i])
    run_rewards = [rewards[final[t]] for t in runs]
    run_groups = [groups[final[t]] for t in runs]
    run_adv = dict(zip(runs, ref_group_adv(run_rewards, run_groups, estimator)))
    out = []
    for i, t in enumerate(trajs):
        a = run_adv[t]
        if divide:
            a /= sum(1 for x in trajs if x == t)
        out.append(a)
    return out


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo", "none"])
@pytest.mark.parametrize("divide", [False, True])
def test_stepwise_advantages_match_loops(estimator, divide):
    # 3 groups of runs; runs have 1..3 steps; rows are shuffled; intermediate-step
    # rewards are noise that must be ignored (only the final step counts).
    g = torch.Generator().manual_seed(5)
    rows = []
    traj = 0
    for group in (10, 20, 30):
        for _ in range(3):
            n_steps = int(torch.randint(1, 4, (1,), generator=g))
            final_r = float(torch.randint(0, 3, (1,), generator=g))
            for s in range(n_steps):
                r = final_r if s == n_steps - 1 else float(torch.randn(1, generator=g)) * 100
                rows.append((r, group, traj * 7 + 1, s * 2))
            traj += 1
    perm = torch.randperm(len(rows), generator=g).tolist()
    rows = [rows[i] for i in perm]
    rewards, groups, trajs, steps = (list(x) for x in zip(*rows))
    got = stepwise_advantages(
        torch.tensor(rewards), torch.tensor(groups), torch.tensor(trajs), torch.tensor(steps), estimator, divide
    )
    ref = ref_stepwise(rewards, groups, trajs, steps, estimator, divide)
    for g_, r_ in zip(got.tolist(), ref):
        assert math.isclose(g_, r_, rel_tol=1e-5, abs_tol=1e-5)


def test_stepwise_rejects_ambiguous_runs():
    r = torch.zeros(3)
    with pytest.raises(ValueError, match="traj_id 4"):
        stepwise_advantages(r, torch.zeros(3, dtype=torch.long), torch.tensor([4, 4, 5]), torch.tensor([1, 1, 0]))
    with pytest.raises(ValueError, match="different group_id"):
        stepwise_advantages(r, torch.tensor([0, 1, 1]), torch.tensor([4, 4, 5]), torch.tensor([0, 1, 0]))


def test_normalize_advantages_matches_loop():
    g = torch.Generator().manual_seed(2)
    adv = torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) > 0.4
    got = normalize_advantages(adv, mask)
    vals = [float(adv[b, t]) for b in range(4) for t in range(6) if mask[b, t]]
    mean, std = statistics.mean(vals), statistics.stdev(vals)
    for b in range(4):
        for t in range(6):
            want = (float(adv[b, t]) - mean) / (std + EPS) if mask[b, t] else 0.0
            assert math.isclose(float(got[b, t]), want, rel_tol=1e-5, abs_tol=1e-6)
    # Degenerate batches: all equal, or a single token, give zeros rather than NaN.
    assert normalize_advantages(torch.full((2, 3), 0.7)).abs().sum() == 0
    one = torch.zeros(2, 3, dtype=torch.bool)
    one[0, 1] = True
    assert normalize_advantages(adv[:2, :3], one).abs().sum() == 0


def test_broadcast_to_tokens():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    got = broadcast_to_tokens(torch.tensor([2.0, -1.0, 3.0]), mask)
    assert got.tolist() == [[0, 2, 2, 0], [-1, -1, 0, 0], [0, 0, 0, 0]]
    with pytest.raises(ValueError, match="loss_mask"):
        broadcast_to_tokens(torch.zeros(2), mask)
