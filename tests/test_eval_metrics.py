"""pass@k / mean@k: the unbiased estimator against enumeration, and evaluation's arithmetic."""

from __future__ import annotations

import itertools

import pytest
import torch
from tensordict import TensorDict

from arealite.reward.metrics import episode_scores, eval_ks, pass_at_k
from arealite.trainer.evaluation import evaluate


@pytest.mark.parametrize("n,c", [(1, 0), (1, 1), (4, 0), (4, 1), (4, 3), (8, 2), (8, 8), (5, 4)])
def test_pass_at_k_equals_the_share_of_k_subsets_with_a_correct_answer(n, c):
    answers = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(answers, k))
        want = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(want), (n, c, k)
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)  # pass@1 is the mean accuracy


def test_eval_ks_and_bad_arguments():
    assert eval_ks(1) == [1] and eval_ks(4) == [1, 2, 4] and eval_ks(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def _group(rewards, lengths, truncated):
    L = max(lengths)
    lm = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    return TensorDict({"rewards": torch.tensor(rewards), "loss_mask": lm, "truncated": torch.tensor(truncated)},
                      batch_size=[len(rewards)])


class FakeRollout:
    """A rollout side that answers greedy and sampled evaluations from fixed groups."""

    def __init__(self):
        self.greedy = [_group([1.0], [3], [False]), _group([0.0], [8], [True]), None]
        self.sampled = [_group([1.0, 0.0, 0.0, 0.0], [2, 8, 8, 3], [False, True, True, False]),
                        _group([0.0, 0.0, 0.0, 0.0], [8, 8, 8, 8], [True] * 4)]

    def eval_sums(self, items, ks=()):
        return episode_scores(self.sampled if ks else self.greedy, list(ks))


def test_evaluate_reports_greedy_pass_at_k_mean_at_k_truncation_and_length():
    out = evaluate(FakeRollout(), [{"prompt": str(i)} for i in range(3)], n_samples=4)  # type: ignore[arg-type]
    assert out["eval/accuracy"] == 0.5 and out["eval/n"] == 2  # the rejected prompt is not counted
    assert out["eval/truncated_frac"] == 0.5 and out["eval/response_len_mean"] == 5.5
    assert out["eval/pass@1"] == pytest.approx((0.25 + 0.0) / 2)
    assert out["eval/pass@2"] == pytest.approx((0.5 + 0.0) / 2)
    assert out["eval/pass@4"] == pytest.approx((1.0 + 0.0) / 2)
    assert out["eval/mean@4"] == pytest.approx(1 / 8)
    assert out["eval/sampled_truncated_frac"] == pytest.approx(6 / 8)
    assert out["eval/sampled_response_len_mean"] == pytest.approx(53 / 8)
    assert "eval/pass@1" not in evaluate(FakeRollout(), [{}], n_samples=1)  # type: ignore[arg-type]
