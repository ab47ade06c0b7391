"""DAPO's soft overlong punishment and overlong filtering."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from arealite.algo.actor import PPOActor
from arealite.algo.overlong import exclude_rows, soft_overlong_penalty, truncated_rows
from arealite.config.schema import AlgorithmConfig, OverlongConfig


def dapo_r_len(n: int, l_max: int, l_cache: int) -> float:
    """DAPO Eq. 13, written out."""
    if n <= l_max - l_cache:
        return 0.0
    if n <= l_max:
        return ((l_max - l_cache) - n) / l_cache
    return -1.0


def test_penalty_matches_dapo_eq13_at_every_length():
    lengths = torch.arange(0, 25)
    got = soft_overlong_penalty(lengths, max_len=20, buffer_len=8, factor=1.0)
    assert got.tolist() == pytest.approx([dapo_r_len(n, 20, 8) for n in range(25)])
    # Hand-worked: 12 is the last free length, 16 is half-way, 20 (the limit) is the full -1.
    assert got[12] == 0 and got[16].item() == pytest.approx(-0.5) and got[20].item() == pytest.approx(-1.0)
    assert soft_overlong_penalty(lengths, 20, 8, factor=0.5)[16].item() == pytest.approx(-0.25)


def test_bad_penalty_arguments_fail():
    with pytest.raises(ValueError, match="buffer"):
        soft_overlong_penalty(torch.tensor([1]), max_len=4, buffer_len=5)
    with pytest.raises(ValueError, match="factor"):
        soft_overlong_penalty(torch.tensor([1]), max_len=4, buffer_len=2, factor=-1)


def test_truncated_rows_prefer_the_workflow_flag():
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0], [1, 1, 1, 1]]).bool()
    assert truncated_rows(mask, max_len=3).tolist() == [True, False, True]
    assert truncated_rows(mask, 3, torch.tensor([False, True, False])).tolist() == [False, True, False]
    assert exclude_rows(mask, torch.tensor([True, False, False]))[0].any() == False  # noqa: E712


def _batch():
    lm = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 0, 0], [0, 1, 1, 1, 1], [0, 1, 0, 0, 0]]).bool()
    return TensorDict({
        "input_ids": torch.ones(4, 5, dtype=torch.long), "attention_mask": torch.ones(4, 5, dtype=torch.bool),
        "loss_mask": lm, "logprobs": torch.zeros(4, 5), "rewards": torch.tensor([1.0, 1.0, 0.0, 0.0]),
        "group_id": torch.tensor([0, 0, 1, 1]), "truncated": torch.tensor([True, False, True, False]),
    }, batch_size=[4])


def test_actor_adds_the_penalty_before_the_group_baseline():
    cfg = AlgorithmConfig(adv_estimator="drgrpo", overlong=OverlongConfig(buffer_len=2))
    batch = _batch()
    actor = PPOActor(cfg, None, 1.0, max_new_tokens=4)  # type: ignore[arg-type]
    actor.compute_advantages(batch)
    # Lengths 4, 2, 4, 1 with L_max 4, L_cache 2: penalties -1, 0, -1, 0 -> rewards 0, 1, -1, 0.
    seq = batch["advantages"][:, 1]
    assert seq.tolist() == pytest.approx([-0.5, 0.5, -0.5, 0.5])
    assert actor.adv_stats["overlong_penalty_mean"] == pytest.approx(-0.5)
    assert actor.adv_stats["overlong_truncated_frac"] == pytest.approx(0.5)


def test_excluded_truncated_samples_leave_the_loss_but_keep_their_mask_for_stats():
    cfg = AlgorithmConfig(adv_estimator="drgrpo", overlong=OverlongConfig(exclude_truncated=True))
    batch = _batch()
    batch["rewards"] = torch.tensor([1.0, 0.0, 0.0, 1.0])
    actor = PPOActor(cfg, None, 1.0, max_new_tokens=4)  # type: ignore[arg-type]
    actor.compute_advantages(batch)
    assert batch["advantages"][0].abs().sum() == 0 and batch["advantages"][2].abs().sum() == 0
    assert batch["advantages"][1].abs().sum() > 0
    seen = {}

    class Engine:
        def train_batch(self, b, loss_fn, weight_fn):
            seen["mask"] = b["loss_mask"].clone()
            return {"loss": 0.0}

    actor.engine = Engine()  # type: ignore[assignment]
    actor.ppo_update(batch)
    assert seen["mask"].sum(-1).tolist() == [0, 2, 0, 1]
    assert batch["loss_mask"].sum(-1).tolist() == [4, 2, 4, 1]  # the caller's batch is untouched
