"""The pipeline in virtual time (`arealite.sim.pipeline`): hand-computed steps, the staleness
rule, and where overlap puts the step between the synchronous one and the bound."""

import pytest

from arealite.sim.cost_model import SimSpec
from arealite.sim.pipeline import PipelineSetup, simulate_pipeline

SPEC = SimSpec(gpu="h100", model="1.5b", time_scale=0.5, length_median=1024, length_sigma=1.0)


def _setup(eta: int, **kw) -> PipelineSetup:
    base = dict(spec=SPEC, n_servers=3, rows_per_server=64, batch_groups=16, group_size=4, eta=eta,
                max_concurrent=64, max_new_tokens=2048, prompt_tokens=40, train_s=0.9, push_s=0.07)
    return PipelineSetup(**{**base, **kw})


def test_a_synchronous_step_is_one_answer_then_training_and_push():
    spec = SimSpec(gpu="h100", model="7b", time_scale=1.0, length_median=50, length_sigma=0.0)
    setup = PipelineSetup(spec, n_servers=1, rows_per_server=64, batch_groups=1, group_size=1, eta=0,
                          max_concurrent=1, max_new_tokens=100, prompt_tokens=10, train_s=0.5, push_s=0.1)
    res = simulate_pipeline(setup, steps=3, skip=0)
    # The prompt's prefill makes the first token, then 49 decode steps of one row.
    answer = spec.prefill_s(10) + spec.steps_s(49, 1, 11)
    assert res.step_ends == pytest.approx([(k + 1) * (answer + 0.6) for k in range(3)], rel=1e-9)
    assert res.staleness_max == 0
    assert res.trainer_wait_s == pytest.approx(answer)


@pytest.mark.parametrize("eta", [1, 2, 4])
def test_the_overdue_hold_keeps_every_batch_within_eta(eta):
    for seed in range(3):
        assert simulate_pipeline(_setup(eta, seed=seed), steps=25).staleness_max <= eta


def test_overlap_lands_between_the_synchronous_step_and_the_never_idle_bound():
    sync = simulate_pipeline(_setup(0), steps=12).step_s(2)
    prev = sync
    for eta in (1, 2, 4):
        step = simulate_pipeline(_setup(eta), steps=12).step_s(2)
        assert 0.97 < step < prev  # never faster than training and push; faster with each eta
        prev = step
    assert sync / prev > 3.5  # eta 4 overlaps most of generation with training


def test_measured_steps_must_remain_after_the_skipped_ones():
    with pytest.raises(ValueError, match="skip=5"):
        simulate_pipeline(_setup(1), steps=5, skip=5)


def test_a_cluster_played_on_fewer_servers_in_proportion_keeps_its_step():
    """The planner plays a large split on a few servers with the batch, the concurrency and the
    per-token training time scaled by the same share: the step stays within 5%."""
    per_token = 0.9 / (16 * 4 * 1100)

    def step(servers: int, share: float) -> float:
        runs = [simulate_pipeline(_setup(4, n_servers=servers, batch_groups=round(16 * share),
                                         max_concurrent=round(64 * share), train_s=0.0,
                                         train_s_per_token=per_token / share, seed=seed), steps=40, skip=20)
                for seed in range(3)]
        return sorted(r.step_s(20) for r in runs)[1]

    whole, played = step(6, 2.0), step(3, 1.0)
    assert played == pytest.approx(whole, rel=0.05)


def test_groups_alike_are_kept_apart():
    """Two running groups with equal fields are two groups: the one that finishes leaves, not its twin."""
    from arealite.sim.pipeline import _Group  # noqa: PLC0415  (private-ok: the pipeline's own record)

    a, b = _Group(version=0, admitted_at=0.0, left=0), _Group(version=0, admitted_at=0.0, left=0)
    running = [a, b]
    running.remove(b)
    assert running[0] is a


def test_a_retract_pause_costs_only_when_answers_are_in_flight():
    """``retract`` (and ``abort``) prefill the answers in flight again after a push: nothing to
    redo at eta 0 (the same steps to the bit), a slower step at eta 4; an unknown mode is named."""
    sync = [simulate_pipeline(_setup(0, pause_mode=m), steps=6).step_ends for m in ("in_place", "retract")]
    assert sync[0] == sync[1]
    for seed in range(2):
        kept = simulate_pipeline(_setup(4, seed=seed), steps=25, skip=10).step_s(10)
        redone = simulate_pipeline(_setup(4, seed=seed, pause_mode="retract"), steps=25, skip=10).step_s(10)
        assert redone > kept * 1.03
    with pytest.raises(ValueError, match="pause_mode 'freeze'"):
        _setup(4, pause_mode="freeze")
