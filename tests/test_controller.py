"""RolloutController: admission, staleness, queues, pause, errors, recovery.

The controller only sees the engine through workflows, so these tests use a
small in-process fake engine; the end-to-end tests in test_workflows.py run
the real client and server.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest
import torch

from arealite.api.types import Completion
from arealite.config.schema import RolloutConfig
from arealite.data.dataset import StatefulDataLoader
from arealite.rollout.controller import InputQueueFull, RolloutController, WorkflowError
from arealite.workflow.base import RolloutWorkflow, new_group_id, pad_and_stack, reject_equal_rewards, trajectory_row


class FakeEngine:
    """Answers every request with ``len(prompt) % 3 + 1`` tokens at its current version."""

    def __init__(self):
        self.version = 0
        self.closed = False
        self.initialized = False

    async def initialize(self, timeout: float = 1.0):
        self.initialized = True

    async def aclose(self):
        self.closed = True

    async def agenerate(self, req):
        await asyncio.sleep(0)
        n = len(req.input_ids) % 3 + 1
        return Completion(req.rid, req.input_ids, [7] * n, [-0.1] * n, [self.version] * n, "stop")


class ItemWorkflow(RolloutWorkflow):
    """One-row group per item; behaviour steered by the item's fields.

    ``gate``: a threading.Event the episode waits for; ``reject``: return None;
    ``fail``: raise; ``reward``: the reward; ``len``: prompt length.
    """

    def __init__(self):
        self.started: list[int] = []

    async def arun_episode(self, client, item):
        self.started.append(item["prompt_id"])
        gate = item.get("gate")
        while gate is not None and not gate.is_set():
            await asyncio.sleep(0.002)
        if item.get("fail"):
            raise ZeroDivisionError(f"boom on {item['prompt_id']}")
        if item.get("reject"):
            return None
        from arealite.api.types import GenerationRequest

        c = await client.agenerate(GenerationRequest(input_ids=list(range(1, item.get("len", 3) + 1))))
        row = trajectory_row(c.input_ids, [(c.output_ids, c.output_logprobs, c.output_versions)])
        return pad_and_stack([row], {
            "rewards": torch.tensor([float(item.get("reward", 1.0))]),
            "group_id": torch.tensor([new_group_id()]),
            "prompt_id": torch.tensor([item["prompt_id"]]),
        })


def make(engine=None, **cfg):
    base = dict(consumer_batch_size=2, max_head_offpolicyness=0, max_concurrent_rollouts=16, queue_size=64)
    base.update(cfg)
    return RolloutController(engine or FakeEngine(), RolloutConfig(**base)).start()


def ids(batch):
    return sorted(batch["prompt_id"].tolist())


def test_batch_is_right_padded_with_the_schema_pad_values():
    ctl = make(consumer_batch_size=4)
    try:
        wf = ItemWorkflow()
        batch = ctl.rollout_batch([{"prompt_id": i, "len": 2 + i} for i in range(4)], wf)
        assert batch.batch_size[0] == 4 and ids(batch) == [0, 1, 2, 3]
        lengths = batch["attention_mask"].sum(1)
        assert batch["input_ids"].shape[1] == int(lengths.max())
        for r in range(4):
            n = int(lengths[r])
            assert not batch["attention_mask"][r, n:].any() and not batch["loss_mask"][r, n:].any()
            assert (batch["versions"][r, n:] == -1).all() and (batch["logprobs"][r, n:] == 0).all()
            assert (batch["input_ids"][r, n:] == 0).all()
            # generated tokens: loss_mask exactly where versions >= 0
            assert torch.equal(batch["loss_mask"][r], batch["versions"][r] >= 0)
        assert ctl.client.initialized
    finally:
        ctl.stop()
    assert ctl.client.closed


def test_staleness_bound_limits_admission_and_rejection_frees_capacity():
    ctl = make(consumer_batch_size=2, max_head_offpolicyness=0)
    try:
        wf = ItemWorkflow()
        gate = threading.Event()
        for i in range(6):
            ctl.submit({"prompt_id": i, "gate": gate, "reject": i in (0, 1)}, wf)
        time.sleep(0.1)
        st = ctl.stats()
        assert st["running"] == 2 and st["input_queue"] == 4, st  # (0 + 0 + 1) * 2 groups
        gate.set()
        batch = ctl.wait(2, timeout=5)
        # items 0 and 1 were rejected; their slots went to items 2 and 3
        assert ids(batch) == [2, 3]
        st = ctl.stats()
        assert st["rejected"] == 2 and st["accepted"] == 2 and st["running"] == 0 and st["input_queue"] == 2
        assert sorted(wf.started) == [0, 1, 2, 3]
        ctl.set_version(1)  # one more batch allowed
        assert ids(ctl.wait(2, timeout=5)) == [4, 5]
    finally:
        ctl.stop()


def test_wait_timeout_raises_and_loses_nothing():
    ctl = make(consumer_batch_size=4, max_head_offpolicyness=1)
    try:
        wf = ItemWorkflow()
        gate = threading.Event()
        ctl.submit({"prompt_id": 0}, wf)
        ctl.submit({"prompt_id": 1}, wf)
        ctl.submit({"prompt_id": 2, "gate": gate}, wf)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="2 groups ready"):
            ctl.wait(3, timeout=0.3)
        assert 0.25 < time.monotonic() - t0 < 3
        gate.set()
        assert ids(ctl.wait(3, timeout=5)) == [0, 1, 2]
        assert ctl.stats()["consumed"] == 3
    finally:
        ctl.stop()


def test_pause_stops_admission_and_resume_restarts_it():
    ctl = make(consumer_batch_size=4, max_head_offpolicyness=1)
    try:
        wf = ItemWorkflow()
        ctl.pause()
        for i in range(3):
            ctl.submit({"prompt_id": i}, wf)
        time.sleep(0.1)
        st = ctl.stats()
        assert st["running"] == 0 and st["input_queue"] == 3 and wf.started == []
        with pytest.raises(TimeoutError, match="paused"):
            ctl.wait(3, timeout=0.1)
        ctl.resume()
        assert ids(ctl.wait(3, timeout=5)) == [0, 1, 2]
    finally:
        ctl.stop()


def test_state_dict_round_trip_loses_and_duplicates_nothing(tmp_path):
    ctl = make(consumer_batch_size=2, max_head_offpolicyness=3, max_concurrent_rollouts=2)
    wf = ItemWorkflow()
    gate = threading.Event()
    items = [{"prompt_id": i, "gate": None if i < 3 else gate} for i in range(8)]
    for it in items:
        ctl.submit(it, wf)
    first = ctl.wait(2, timeout=5)  # 2 consumed; 1 ready; 2 running (gated); 3 queued
    time.sleep(0.05)
    ctl.set_version(1)
    state = ctl.state_dict()
    before = ctl.stats()
    ctl.stop()
    assert before["output_queue"] == 1 and before["running"] == 2
    # Through a real file, as the checkpoint will do (threading.Event does not pickle: strip it).
    for i, it in enumerate(state["pending_items"]):
        state["pending_items"][i] = {k: v for k, v in it.items() if k != "gate"}
    state["ready"] = [(d, {k: v for k, v in it.items() if k != "gate"}) for d, it in state["ready"]]
    torch.save(state, tmp_path / "ctl.pt")
    state = torch.load(tmp_path / "ctl.pt", weights_only=False)

    ctl2 = RolloutController(FakeEngine(), ctl.config)
    ctl2.load_state_dict(state)
    ctl2.start()
    try:
        after = ctl2.stats()
        for k in ("submitted", "accepted", "rejected", "failed", "consumed", "version"):
            assert after[k] == before[k], k
        assert ctl2.resubmit_pending(ItemWorkflow()) == 5
        assert ctl2.stats()["submitted"] == before["submitted"]  # resubmission is not a new submission
        seen = ids(first)
        for _ in range(3):
            seen += ids(ctl2.wait(2, timeout=5))
            ctl2.set_version(ctl2.get_version() + 1)
        assert sorted(seen) == list(range(8))  # every item exactly once
    finally:
        ctl2.stop()


def _fed():
    """A started controller (2 groups a step, eta = 1), a workflow and a 20-item loader."""
    loader = StatefulDataLoader([{"prompt_id": i} for i in range(20)], batch_size=2, shuffle=False)
    return make(consumer_batch_size=2, max_head_offpolicyness=1), ItemWorkflow(), loader


def test_prepare_batch_keeps_the_next_step_generating():
    ctl, wf, loader = _fed()
    try:
        b0 = ctl.prepare_batch(loader, wf)
        assert b0.batch_size[0] == 2
        time.sleep(0.1)  # the trainer "trains" on b0 ...
        st = ctl.stats()
        # ... while step 1's groups were already generated (eta=1 lets one batch run ahead).
        assert st["output_queue"] + st["running"] >= 2, st
        ctl.set_version(1)
        b1 = ctl.prepare_batch(loader, wf)
        assert set(ids(b0)).isdisjoint(ids(b1))
        seen = ids(b0) + ids(b1)
        for v in range(2, 12):  # wraps into the second epoch without losing an item
            ctl.set_version(v)
            seen += ids(ctl.prepare_batch(loader, wf))
        assert sorted(seen[:20]) == list(range(20))
    finally:
        ctl.stop()


def test_the_first_batch_generates_alone_then_the_bound_runs_ahead():
    ctl = make(consumer_batch_size=2, max_head_offpolicyness=2)
    gate = threading.Event()
    try:
        wf = ItemWorkflow()
        loader = StatefulDataLoader([{"prompt_id": i, "gate": gate} for i in range(20)], batch_size=2, shuffle=False)
        first = []
        t = threading.Thread(target=lambda: first.append(ctl.prepare_batch(loader, wf)))
        t.start()
        time.sleep(0.1)
        st = ctl.stats()
        assert st["running"] == 2 and st["capacity"] == 0, st  # eta=2 alone would allow 6
        gate.set()
        t.join(5)
        assert ids(first[0]) == [0, 1]
        deadline = time.monotonic() + 5
        while ctl.stats()["consumed"] + ctl.stats()["output_queue"] + ctl.stats()["running"] < 6:
            assert time.monotonic() < deadline, ctl.stats()  # the two batches eta=2 allows ahead
            time.sleep(0.005)
    finally:
        gate.set()
        ctl.stop()


def _stash_after_push(ctl, loader, wf, version):
    """A step's end: pause, new version, resume with prefetch once a whole batch is ready."""
    ctl.pause()
    ctl.set_version(version)
    deadline = time.monotonic() + 5
    while ctl.stats()["output_queue"] < ctl.batch_size:
        assert time.monotonic() < deadline, ctl.stats()
        time.sleep(0.005)
    ctl.resume(prefetch=(loader, wf))


def test_resume_takes_a_ready_batch_ahead_and_prepare_batch_needs_no_loop():
    ctl, wf, loader = _fed()
    try:
        b0 = ctl.prepare_batch(loader, wf)
        _stash_after_push(ctl, loader, wf, 1)
        assert not ctl.paused
        time.sleep(0.05)  # the loop took the batch ahead, then admitted
        assert ctl.stats()["consumed"] == 4
        # The loop is busy (a burst of launches, here a blocking callback): the stashed batch
        # comes back at once, without a trip there.
        release = threading.Event()
        ctl._loop.call_soon_threadsafe(release.wait, 5)
        t0 = time.monotonic()
        b1 = ctl.prepare_batch(loader, wf)
        elapsed = time.monotonic() - t0
        release.set()
        assert elapsed < 1.0 and b1.batch_size[0] == 2
        assert set(ids(b0)).isdisjoint(ids(b1)) and sorted(ids(b0) + ids(b1)) == [0, 1, 2, 3]
        assert sorted(it["prompt_id"] for it in ctl.last_batch_items) == ids(b1)
        assert sum(ctl.stats()["staleness_hist"].values()) == 4  # recorded once per row
    finally:
        ctl.stop()


def test_a_stashed_batch_is_saved_as_ready_and_handed_out_once():
    ctl, wf, loader = _fed()
    try:
        b0 = ctl.prepare_batch(loader, wf)
        _stash_after_push(ctl, loader, wf, 1)
        time.sleep(0.05)
        # A checkpoint between the resume and the next prepare_batch: the stashed groups are
        # not trained on yet, so they are saved as ready and not counted as consumed.
        state = ctl.state_dict()
        assert state["counters"]["consumed"] == 2
        ready = sorted(int(d["prompt_id"][0]) for d, _ in state["ready"])
        assert set(ready) >= {2, 3} and not set(ready) & set(ids(b0))
        assert sum(state["staleness_hist"].values()) == 2
        # ... and the next batch is the same groups, taken from the queue this time.
        b1 = ctl.prepare_batch(loader, wf)
        assert ids(b1) == [2, 3] and ctl.stats()["consumed"] == 4
        # wait() also puts a stash back first: groups go out in completion order.
        _stash_after_push(ctl, loader, wf, 2)
        time.sleep(0.05)
        assert ids(ctl.wait(2, timeout=5)) == [4, 5]
        assert ctl.prepare_batch(loader, wf).batch_size[0] == 2 and ctl.stats()["consumed"] == 8
    finally:
        ctl.stop()


def test_back_pressure_bounds_the_queues():
    ctl = make(consumer_batch_size=2, max_head_offpolicyness=100, queue_size=4)
    try:
        wf = ItemWorkflow()
        for i in range(4):
            ctl.submit({"prompt_id": i}, wf)
        time.sleep(0.1)
        for i in range(4, 8):
            ctl.submit({"prompt_id": i}, wf)
        time.sleep(0.1)
        st = ctl.stats()
        # A slow consumer: the output queue is full, so nothing more is admitted.
        assert st["output_queue"] == 4 and st["running"] == 0 and st["input_queue"] == 4, st
        with pytest.raises(InputQueueFull, match="queue_size"):
            ctl.submit({"prompt_id": 99}, wf)
        assert ids(ctl.wait(4, timeout=5)) == [0, 1, 2, 3]
        assert ids(ctl.wait(4, timeout=5)) == [4, 5, 6, 7]
        with pytest.raises(ValueError, match="queue_size"):
            ctl.wait(5)
    finally:
        ctl.stop()


def test_failing_workflow_fail_policy_raises_with_item_and_traceback():
    ctl = make(consumer_batch_size=2, max_head_offpolicyness=2)
    try:
        wf = ItemWorkflow()
        ctl.submit({"prompt_id": 0}, wf)
        ctl.submit({"prompt_id": 41, "fail": True}, wf)
        with pytest.raises(WorkflowError) as ei:
            ctl.wait(2, timeout=5)
        msg = str(ei.value)
        assert "'prompt_id': 41" in msg and "ZeroDivisionError: boom on 41" in msg and "on_workflow_error" in msg
        assert ei.value.item["prompt_id"] == 41
        st = ctl.stats()
        assert st["failed"] == 1 and st["running"] == 0
        # The error is reported once; the good group is still there.
        ctl.submit({"prompt_id": 1}, wf)
        assert ids(ctl.wait(2, timeout=5)) == [0, 1]
    finally:
        ctl.stop()


def test_failing_workflow_drop_policy_goes_on_and_never_hangs():
    ctl = make(consumer_batch_size=2, max_head_offpolicyness=2, on_workflow_error="drop")
    try:
        wf = ItemWorkflow()
        for i in range(4):
            ctl.submit({"prompt_id": i, "fail": i % 2 == 1}, wf)
        assert ids(ctl.wait(2, timeout=5)) == [0, 2]
        assert ctl.stats()["failed"] == 2
        # Nothing running or queued: waiting for more is an immediate error, not a hang.
        with pytest.raises(RuntimeError, match="never complete"):
            ctl.wait(1)
    finally:
        ctl.stop()


def test_malformed_trajectory_is_a_workflow_error_naming_the_key():
    class Bad(RolloutWorkflow):
        async def arun_episode(self, client, item):
            td = await ItemWorkflow().arun_episode(client, item)
            del td["versions"]
            return td

    ctl = make()
    try:
        ctl.submit({"prompt_id": 0}, Bad())
        with pytest.raises(WorkflowError, match="missing key 'versions'"):
            ctl.wait(1, timeout=5)
    finally:
        ctl.stop()


def test_forgotten_version_bump_is_reported_not_hung():
    ctl = make(consumer_batch_size=2, max_head_offpolicyness=0)
    try:
        wf = ItemWorkflow()
        loader = StatefulDataLoader([{"prompt_id": i} for i in range(8)], batch_size=2, shuffle=False)
        ctl.prepare_batch(loader, wf)
        with pytest.raises(RuntimeError, match="set_version"):
            ctl.prepare_batch(loader, wf)
    finally:
        ctl.stop()


def test_should_accept_filters_and_staleness_histogram():
    eng = FakeEngine()
    ctl = make(eng, consumer_batch_size=2, max_head_offpolicyness=4)
    try:
        wf = ItemWorkflow()
        for i in range(4):
            ctl.submit({"prompt_id": i, "reward": i}, wf)
        time.sleep(0.05)
        ctl.set_version(3)  # the trainer moved on; these were made at version 0
        batch = ctl.wait(2, timeout=5, should_accept=lambda td: td["rewards"][0] >= 2)
        assert ids(batch) == [2, 3]
        st = ctl.stats()
        assert st["rejected"] == 2 and st["staleness_hist"] == {3: 2}
    finally:
        ctl.stop()
    two = pad_and_stack([trajectory_row([1], [([2], [0.0], [0])])] * 2, {"rewards": torch.tensor([1.0, 1.0])})
    assert not reject_equal_rewards(two)
    two["rewards"][1] = 0.0
    assert reject_equal_rewards(two)


def test_stop_cancels_running_episodes_and_joins_the_thread():
    ctl = make(consumer_batch_size=4, max_head_offpolicyness=1)
    gate = threading.Event()
    wf = ItemWorkflow()
    for i in range(3):
        ctl.submit({"prompt_id": i, "gate": gate}, wf)
    time.sleep(0.05)
    thread = ctl._thread
    t0 = time.monotonic()
    ctl.stop()
    assert time.monotonic() - t0 < 2
    assert not thread.is_alive() and ctl.client.closed
    assert [it["prompt_id"] for it in ctl.state_dict()["pending_items"]] == [0, 1, 2]
    assert not any(t.name == "arealite-rollout" for t in threading.enumerate())


def test_ctrl_c_interrupts_a_blocked_wait_promptly():
    ctl = make()
    gate = threading.Event()
    ctl.submit({"prompt_id": 0, "gate": gate}, ItemWorkflow())

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            ctl.wait(1)
        assert time.monotonic() - t0 < 2
        # The interrupted wait took nothing: the group is still delivered afterwards.
        gate.set()
        assert ids(ctl.wait(1, timeout=5)) == [0]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        ctl.stop()


def test_run_executes_coroutines_on_the_controller_loop():
    ctl = make()
    try:
        async def where():
            return threading.current_thread().name

        assert ctl.run(where()) == "arealite-rollout"
        with pytest.raises(TimeoutError):
            ctl.run(asyncio.sleep(5), timeout=0.1)
    finally:
        ctl.stop()


def test_hanging_reward_through_the_controller_is_counted_not_hung(micro_model_dir):
    from transformers import AutoTokenizer

    from arealite.config.schema import GenerationConfig
    from arealite.workflow.rlvr import RLVRWorkflow

    tok = AutoTokenizer.from_pretrained(micro_model_dir)

    def slow_reward(*a, **k):
        time.sleep(20)

    ctl = make(reward_timeout_s=0.2)
    try:
        wf = RLVRWorkflow(slow_reward, GenerationConfig(n_samples=2, max_new_tokens=4), tok, ctl.config)
        t0 = time.monotonic()
        batch = ctl.rollout_batch([{"prompt": "a", "prompt_id": 0}, {"prompt": "b", "prompt_id": 1}], wf)
        assert time.monotonic() - t0 < 3
        assert batch["rewards"].tolist() == [0.0] * 4  # on_reward_error='zero'
        st = ctl.stats()
        assert st["workflow/reward_errors"] == 4 and st["workflow/reward_abandoned_threads"] == 4
    finally:
        ctl.stop()


def test_loop_thread_runs_torch_single_threaded_and_old_objects_are_frozen():
    """The loop's small tensor ops stay off OpenMP teams (whose workers spin after each
    parallel op); the trainer thread keeps its threads; the heap is frozen at start."""
    import gc

    gc.unfreeze()
    main_threads = torch.get_num_threads()
    ctl = make()
    try:
        assert ctl._call(torch.get_num_threads) == 1
        assert torch.get_num_threads() == main_threads
        assert gc.get_freeze_count() > 0
    finally:
        ctl.stop()
        gc.unfreeze()
    ctl = make(freeze_gc=False)
    try:
        assert gc.get_freeze_count() == 0
    finally:
        ctl.stop()


def test_switch_interval_and_gc_threshold_are_set_while_running_and_restored():
    import gc
    import sys

    before, gc_before = sys.getswitchinterval(), gc.get_threshold()
    ctl = make(gil_switch_interval_ms=0.25, gc_young_threshold=12345)
    try:
        assert sys.getswitchinterval() == pytest.approx(0.00025)
        assert gc.get_threshold() == (12345, *gc_before[1:])
    finally:
        ctl.stop()
    assert sys.getswitchinterval() == before and gc.get_threshold() == gc_before
    ctl = make(gil_switch_interval_ms=None, gc_young_threshold=None)
    try:
        assert sys.getswitchinterval() == before and gc.get_threshold() == gc_before
    finally:
        ctl.stop()


async def test_reward_workers_run_torch_single_threaded():
    from arealite.reward.pool import RewardRunner

    runner = RewardRunner(timeout_s=5, workers=2)
    assert await runner(lambda: float(torch.get_num_threads())) == 1.0


def test_ready_groups_hand_out_the_stalest_groups_first():
    from tensordict import TensorDict

    from arealite.rollout.ready import ReadyGroups

    def group(version: int, tag: int) -> TensorDict:
        return TensorDict({"input_ids": torch.full((2, 3), tag), "loss_mask": torch.tensor([[0, 1, 1]] * 2).bool(),
                           "attention_mask": torch.ones(2, 3, dtype=torch.bool),
                           "versions": torch.tensor([[-1, version, version + 1]] * 2)}, batch_size=[2])

    ready = ReadyGroups()
    for tag, version in enumerate([3, 3, 1, 2, 3]):  # completion order; tag 2 finished late behind a long answer
        ready.put(group(version, tag), {"tag": tag})
    batch, items = ready.take(2, version=4)
    assert [i["tag"] for i in items] == [2, 3]  # the two stalest, in completion order
    assert batch["versions"][:, 1].tolist() == [1, 1, 2, 2]
    assert sorted(ready.staleness_hist.items()) == [(2, 2), (3, 2)]
    _, items = ready.take(3, version=5)  # no choice left: completion order
    assert [i["tag"] for i in items] == [0, 1, 4] and len(ready) == 0


def test_ready_groups_keep_their_order_across_takes_put_backs_and_filters():
    from tensordict import TensorDict

    from arealite.rollout.ready import ReadyGroups

    def group(version: int, tag: int) -> TensorDict:
        return TensorDict({"input_ids": torch.full((1, 2), tag), "loss_mask": torch.tensor([[0, 1]]).bool(),
                           "attention_mask": torch.ones(1, 2, dtype=torch.bool),
                           "versions": torch.tensor([[-1, version]])}, batch_size=[1])

    ready = ReadyGroups()
    for tag, version in enumerate([2, 0, 1, 0, 2]):
        ready.put(group(version, tag), {"tag": tag})
    assert [i["tag"] for i in ready.take(2, version=2)[1]] == [1, 3]  # both of version 0
    ready.put(group(0, 5), {"tag": 5})  # arrives after a take: indexed by the next one
    ready.stash(2, version=2)  # takes 2 (version 1) and 5 (version 0) ahead of a prepare_batch
    assert ready.stashed == 2 and len(ready) == 2
    assert ready.unstash() == 2  # back in front, as if never taken
    assert len(ready) == 4 and ready.count_from(0) == 1 and ready.count_from(1) == 2
    ready.put(group(1, 6), {"tag": 6})
    assert ready.filter(lambda td: int(td["input_ids"][0, 0]) != 4) == [{"tag": 4}]
    assert [i["tag"] for i in ready.take(2, version=2)[1]] == [2, 5]  # 5 is stalest; 2 (put back first) beats 6
    assert [i["tag"] for i in ready.take(1, version=2)[1]] == [6]
    ready.put(group(0, 7), {"tag": 7})
    state = ready.state_dict()
    assert [item["tag"] for _, item in state["ready"]] == [0, 7]  # completion order
    again = ReadyGroups()
    again.load_state_dict(state)
    assert [i["tag"] for i in again.take(1, version=2)[1]] == [7]


def test_ready_groups_age_by_admission_version_through_stash_and_checkpoint():
    """A group the controller puts with its admission version is aged by it, not by its tokens
    (newer when an answer waited in a server's queue past a push): the overdue rule counts
    running groups by admission, so ready ones must be counted alike. The age survives a
    stash put back and a checkpoint; a group put without one is aged by its tokens."""
    from tensordict import TensorDict

    from arealite.rollout.ready import ReadyGroups

    def group(token_version: int, tag: int) -> TensorDict:
        return TensorDict({"input_ids": torch.full((1, 2), tag), "loss_mask": torch.tensor([[0, 1]]).bool(),
                           "attention_mask": torch.ones(1, 2, dtype=torch.bool),
                           "versions": torch.tensor([[-1, token_version]])}, batch_size=[1])

    ready = ReadyGroups()
    ready.put(group(2, 0), {"tag": 0}, admitted_at=2)
    ready.put(group(3, 1), {"tag": 1}, admitted_at=0)  # queued past three pushes: tokens of 3, admitted at 0
    ready.put(group(1, 2), {"tag": 2})  # no admission version (restored): its tokens' 1
    ready.put(group(2, 3), {"tag": 3}, admitted_at=1)
    assert ready.count_from(0) == 1 and ready.count_from(1) == 3 and ready.count_from(2) == 4
    ready.stash(2, version=3)
    assert ready.unstash() == 2
    assert ready.count_from(0) == 1 and ready.count_from(1) == 3  # ages kept across the put back
    state = ready.state_dict()
    assert state["admitted_at"] == [0, 1, 2, 1]  # completion order: 1 and 2 went back in front
    again = ReadyGroups()
    again.load_state_dict(state)
    _, items = again.take(3, version=3)
    assert [i["tag"] for i in items] == [1, 2, 3]  # by age 0, 1, 1; not by tokens (3, 1, 2)
    old = {k: v for k, v in state.items() if k != "admitted_at"}  # a checkpoint from before ages
    again = ReadyGroups()
    again.load_state_dict(old)
    assert [i["tag"] for i in again.take(1, version=3)[1]] == [2]  # by tokens: 2 has version 1
