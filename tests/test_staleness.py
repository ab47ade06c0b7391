"""The staleness bound, as a specification: never exceeded, always used."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from arealite.rollout.staleness import StalenessManager, trajectory_staleness


def admit_all(sm: StalenessManager, queued: int) -> int:
    """What the controller does after every event: admit while the bound allows."""
    n = 0
    while queued > 0 and sm.capacity() > 0:
        sm.on_submit()
        queued -= 1
        n += 1
    return n


ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(1, 5)),
        st.tuples(st.just("accept"), st.just(0)),
        st.tuples(st.just("reject"), st.just(0)),
        st.tuples(st.just("bump"), st.just(0)),
        st.tuples(st.just("consume_filter"), st.just(0)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(
    ops=ops,
    eta=st.integers(0, 3),
    batch=st.integers(1, 4),
    max_concurrent=st.integers(1, 8),
)
def test_bound_holds_and_capacity_is_used(ops, eta, batch, max_concurrent):
    sm = StalenessManager(max_concurrent, batch, eta)
    queued = 0
    for op, arg in ops:
        if op == "submit":
            queued += arg
        elif op == "accept" and sm.running:
            sm.on_accept()
        elif op == "reject" and sm.running:
            sm.on_reject()
        elif op == "bump":
            sm.set_version(sm.version + 1)
        elif op == "consume_filter" and sm.accepted:
            sm.on_unaccept(1)  # a filter at consumption time rejects an accepted group
        queued -= admit_all(sm, queued)
        # The bound: never more groups accepted or running than (eta + v + 1) * B.
        assert sm.accepted + sm.running <= (eta + sm.version + 1) * batch
        assert 0 <= sm.running <= max_concurrent
        # Work-conserving: if items wait, it is because one of the two limits is reached.
        if queued > 0:
            assert sm.running == max_concurrent or sm.accepted + sm.running == (eta + sm.version + 1) * batch


def test_synchronous_rl_admits_one_batch_per_version():
    sm = StalenessManager(max_concurrent=100, consumer_batch_size=3, max_head_offpolicyness=0)
    assert admit_all(sm, 10) == 3
    for _ in range(3):
        sm.on_accept()
    assert sm.capacity() == 0, "eta=0: nothing more until the trainer consumed and bumped the version"
    sm.set_version(1)
    assert admit_all(sm, 10) == 3


def test_rejection_frees_its_slot():
    sm = StalenessManager(max_concurrent=100, consumer_batch_size=2, max_head_offpolicyness=0)
    assert admit_all(sm, 5) == 2
    sm.on_reject()
    assert sm.capacity() == 1
    sm.on_accept()
    assert sm.capacity() == 1  # one accepted, one slot left at version 0


def test_state_round_trip_keeps_the_bound():
    sm = StalenessManager(8, 2, 1, version=3)
    admit_all(sm, 6)
    for _ in range(4):
        sm.on_accept()
    restored = StalenessManager(8, 2, 1)
    restored.load_state_dict(sm.state_dict())
    assert (restored.version, restored.accepted, restored.running) == (3, sm.accepted, 0)
    # Running groups are resubmitted after a resume: exactly as many fit again.
    assert restored.capacity() == sm.capacity() + sm.running


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_concurrent=0, consumer_batch_size=1, max_head_offpolicyness=0), "max_concurrent"),
        (dict(max_concurrent=1, consumer_batch_size=0, max_head_offpolicyness=0), "consumer_batch_size"),
        (dict(max_concurrent=1, consumer_batch_size=1, max_head_offpolicyness=-1), "max_head_offpolicyness"),
    ],
)
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StalenessManager(**kwargs)


def test_admitting_past_the_bound_is_an_error():
    sm = StalenessManager(1, 1, 0)
    sm.on_submit()
    with pytest.raises(RuntimeError, match="staleness bound"):
        sm.on_submit()


def test_trajectory_staleness_is_version_minus_oldest_produced_token():
    # Prompt tokens carry -1 and are not the policy's; a partial rollout mixes versions.
    versions = torch.tensor([
        [-1, -1, 3, 3, 4],   # oldest produced token: 3
        [-1, 5, 5, -1, -1],  # 5: newer than the trainer (it lags the servers for a moment) -> 0
        [-1, -1, -1, -1, -1],  # no produced token -> 0
        [-1, 0, 1, 2, 4],    # 0
    ])
    loss_mask = versions >= 0
    got = trajectory_staleness(versions, loss_mask, version=4)
    assert got.dtype == torch.int64 and got.tolist() == [1, 0, 0, 4]
    # Only the loss mask decides which tokens count, whatever their version.
    assert trajectory_staleness(versions, torch.zeros_like(loss_mask), 4).tolist() == [0, 0, 0, 0]
    assert trajectory_staleness(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.bool), 1).tolist() == [0, 0]


class _LongAnswerEngine:
    """Answers at the version it held when the request arrived; a 9-token prompt (the long
    answer) is held until ``release`` is set, as a long-tailed answer keeps generating."""

    def __init__(self):
        import threading

        self.version = 0
        self.release = threading.Event()

    async def initialize(self, timeout: float = 1.0):
        pass

    async def aclose(self):
        pass

    async def agenerate(self, req):
        import asyncio

        from arealite.api.types import Completion

        version = self.version
        while len(req.input_ids) == 9 and not self.release.is_set():
            await asyncio.sleep(0.002)
        return Completion(req.rid, req.input_ids, [7, 7], [-0.1, -0.1], [version, version], "stop")


def _held_run(eta: int, long_items: set[int]):
    """A controller (2 groups a step, bound ``eta``) over 16 items whose ``long_items`` generate
    until the engine's ``release``; its engine, loader and workflow."""
    from arealite.config.schema import RolloutConfig
    from arealite.data.dataset import StatefulDataLoader
    from arealite.rollout.controller import RolloutController
    from tests.test_controller import ItemWorkflow

    engine = _LongAnswerEngine()
    ctl = RolloutController(engine, RolloutConfig(consumer_batch_size=2, max_head_offpolicyness=eta,
                                                  max_concurrent_rollouts=16, queue_size=64)).start()
    items = [{"prompt_id": i, "len": 9 if i in long_items else 3} for i in range(16)]
    return ctl, engine, StatefulDataLoader(items, batch_size=2, shuffle=False), ItemWorkflow()


def _held_batch(ctl, engine, loader, wf, version: int):
    """Step to ``version``; check that its batch is held until the long answers are released."""
    import threading
    import time

    engine.version = version
    ctl.set_version(version)
    held_before = ctl.stats()["overdue_wait_s"]
    got = []
    t = threading.Thread(target=lambda: got.append(ctl.prepare_batch(loader, wf)))
    t.start()
    time.sleep(0.3)
    assert not got, "the batch went out without the overdue group"
    assert ctl.stats()["output_queue"] >= 2  # two groups were ready: enough for a batch
    engine.release.set()
    t.join(5)
    # The hold is logged: the batch waited ~0.3 s with enough groups ready.
    assert ctl.stats()["overdue_wait_s"] - held_before >= 0.2
    return got[0]


def _finish(ctl, engine, loader, wf, seen: list[int], first: int, eta: int) -> None:
    from tests.test_controller import ids

    for v in range(first, first + 4):
        engine.version = v
        ctl.set_version(v)
        seen += ids(ctl.prepare_batch(loader, wf))
    assert max(ctl.stats()["staleness_hist"]) <= eta, ctl.stats()["staleness_hist"]
    assert len(set(seen)) == len(seen)


def test_a_training_batch_waits_for_a_group_that_would_overrun_the_bound():
    """eta = 1, two groups a step: item 2 is admitted at version 0 and still generating when
    the version-1 batch is due; left to the next batch it would be trained 2 versions stale.
    The batch waits for it (and takes it), and no trajectory is ever trained past eta."""
    from tests.test_controller import ids

    ctl, engine, loader, wf = _held_run(1, {2})
    try:
        seen = ids(ctl.prepare_batch(loader, wf))
        assert sorted(seen) == [0, 1]
        batch = _held_batch(ctl, engine, loader, wf, 1)  # items 3 (version 0), 4 and 5 were ready
        assert sorted(ids(batch)) == [2, 3]  # the two stalest: the late group is in
        _finish(ctl, engine, loader, wf, seen + ids(batch), 2, eta=1)
    finally:
        ctl.stop()


def test_a_batch_waits_when_more_late_groups_run_than_the_next_batches_hold():
    """eta = 2: after the first batch, items 2-5 start at version 0 and 2, 3, 4 generate long.
    At version 1 none is overdue yet, but three groups of version 0 cannot all fit in the
    version-2 batch: the version-1 batch waits for them instead of taking items 5 and 6."""
    from tests.test_controller import ids

    ctl, engine, loader, wf = _held_run(2, {2, 3, 4})
    try:
        seen = ids(ctl.prepare_batch(loader, wf))
        batch = _held_batch(ctl, engine, loader, wf, 1)
        assert set(ids(batch)) <= {2, 3, 4, 5}  # version-0 groups only
        _finish(ctl, engine, loader, wf, seen + ids(batch), 2, eta=2)
    finally:
        ctl.stop()


def test_ready_groups_age_a_batch_of_groups_as_one_by_one():
    from arealite.rollout.ready import ReadyGroups
    from arealite.workflow.base import group_from_outputs

    def group(vers_per_sample):  # one row per sample; a sample with no tokens has no version
        outs = [(list(range(5, 5 + len(v))), [-0.1] * len(v), v) for v in vers_per_sample]
        per_row = {"rewards": torch.zeros(len(outs)), "group_id": torch.zeros(len(outs), dtype=torch.int64)}
        return group_from_outputs([1, 2, 3], outs, per_row)

    ready = ReadyGroups()
    shapes = [[[3, 4]], [[5], [2, 6, 7]], [[], [9]], [[8, 8, 8]], [[]]]
    for i, s in enumerate(shapes):
        ready.put(group(s), {"i": i})
    # oldest produced tokens: 3, 2, 9, 8, none
    assert [ready.count_from(v) for v in (1, 2, 3, 8, 9, 10**6)] == [0, 1, 2, 3, 4, 4]
    batch, items = ready.take(2, 10)
    assert [it["i"] for it in items] == [0, 1]  # the stalest two, in completion order
