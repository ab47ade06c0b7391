"""The rollout side in a child process (`RolloutWorker`) against a real embedded server:
it produces the batches, state and evaluation the in-process `LocalRollout` does, reports
its errors and its death instead of hanging, dies with its parent, and the trainer falls
back to a thread for workflows a worker cannot import."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from transformers import AutoTokenizer

from arealite.config.loader import load_config
from arealite.config.run import ENV_SERVER_ADDRS
from arealite.rollout.build import build_inference_client
from arealite.rollout.side import LocalRollout
from arealite.rollout.worker import CoreMigration, RolloutWorker, RolloutWorkerError, WorkerSpec, runs_in_a_worker
from arealite.server.process import ServerProcess
from arealite.trainer import build
from arealite.utils import procs
from conftest import REPO, free_port

ITEMS = [{"prompt": f"reverse {n} =", "answer": str(n)[::-1], "prompt_id": i}
         for i, n in enumerate([123, 4567, 890, 3141, 2718, 1618, 4242, 9001])]


@pytest.fixture(scope="module")
def server(micro_model_dir):
    port = free_port()
    with ServerProcess(micro_model_dir, port, threads=1) as s:
        s.wait_healthy()
        yield f"127.0.0.1:{port}"


@pytest.fixture()
def cfg(micro_model_dir, server, monkeypatch):
    monkeypatch.setenv(ENV_SERVER_ADDRS, server)
    return load_config(None, [f"actor.model_path={micro_model_dir}", "rollout.consumer_batch_size=2",
                              "generation.n_samples=2", "generation.max_new_tokens=4",
                              "data.reward_fn=arealite.reward.reverse_digits:reverse_digits_reward",
                              "rollout.max_head_offpolicyness=1"], check_paths=False)


def _worker(cfg) -> RolloutWorker:
    tok = AutoTokenizer.from_pretrained(cfg.actor.model_path)
    loader = build.make_loader(cfg, list(ITEMS), rank=0, world=1)
    return RolloutWorker(WorkerSpec(cfg, 1, loader), admin_client=build_inference_client(cfg, tok))


@pytest.mark.slow
def test_worker_produces_batches_state_and_evaluation(cfg):
    worker = _worker(cfg)
    try:
        worker.start(0)
        batch = worker.prepare_batch()
        assert batch["input_ids"].shape[0] == 4 and batch["versions"].max().item() == 0
        # The dropped items came with the batch: taking them costs no round trip.
        calls = []
        real_call = worker.call
        worker.call = lambda name, *a, **kw: (calls.append(name), real_call(name, *a, **kw))[1]
        assert len(worker.last_batch_items) == 2 and worker.take_dropped() == [] and calls == []
        worker.pause()
        worker.set_version(1)
        worker.resume()
        at_pause = worker.stats()  # the first read after a pause: the figures from before it
        assert at_pause["controller"]["version"] == 0 and not at_pause["controller"]["paused"]
        stats = worker.stats()
        assert worker.take_dropped() == [] and calls[-1] == "take_dropped"  # other calls came since the batch
        assert stats["controller"]["version"] == 1 and stats["client"]["requests"] >= 4
        state = worker.controller_state.state_dict()
        assert state["counters"]["consumed"] == 2 and "pending_items" in state
        loader_state = worker.loader_state.state_dict()
        worker.loader_state.load_state_dict(loader_state)
        sums = worker.eval_sums(ITEMS[:3])
        correct, n = sums["correct"], sums["n"]
        assert n == 3 and 0 <= correct <= n  # the evaluation copy: one greedy sample per prompt
        # 8 items: the resume may have taken the next batch ahead and refilled from epoch 2.
        assert worker.epochs_handed_out() in (0, 1)
        admin = worker.admin  # the trainer's own client administers the same servers
        assert admin.healthy_servers == [os.environ[ENV_SERVER_ADDRS]]
        assert worker.run(admin.continue_generation()) is not None
    finally:
        worker.stop()
        worker.stop()  # twice is fine
    assert worker.proc.poll() is not None
    with pytest.raises(RolloutWorkerError, match="stopped"):
        worker.prepare_batch()


@pytest.mark.slow
def test_an_error_in_the_worker_is_raised_in_the_trainer_and_a_dead_worker_is_named(cfg):
    worker = _worker(cfg)
    try:
        with pytest.raises(RolloutWorkerError, match="ControllerStopped|not running"):
            worker.prepare_batch()  # before start(): the child's controller refuses
        worker.start(0)
        os.kill(worker.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RolloutWorkerError, match=r"died with exit code -9 during prepare_batch"):
            worker.prepare_batch()
        assert time.monotonic() - t0 < 10
    finally:
        worker.stop()


PARENT = textwrap.dedent('''
    import os, sys, time
    sys.path.insert(0, sys.argv[1])
    from test_rollout_worker import _worker
    from arealite.config.loader import load_config
    cfg = load_config(None, [f"actor.model_path={sys.argv[2]}", "data.reward_fn=arealite.reward.reverse_digits:reverse_digits_reward"], check_paths=False)
    w = _worker(cfg)
    print(w.proc.pid, flush=True)
    time.sleep(600)
''')


@pytest.mark.slow
def test_the_worker_dies_with_its_trainer(cfg, micro_model_dir, tmp_path):
    (tmp_path / "parent.py").write_text(PARENT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO)]))
    parent = subprocess.Popen([sys.executable, str(tmp_path / "parent.py"), str(REPO / "tests"),
                               str(micro_model_dir)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        child = int(parent.stdout.readline())
        assert procs.is_alive(child)
        parent.kill()  # SIGKILL: no cleanup code runs in the trainer
        deadline = time.monotonic() + 10
        while procs.is_alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not procs.is_alive(child)
    finally:
        parent.kill()
        parent.wait()


class _InMain:
    async def arun_episode(self, client, item):
        return None


def test_workflows_a_worker_cannot_import_run_in_a_thread(cfg, caplog):
    _InMain.__module__ = "__main__"  # as if defined in the training script itself
    assert "defined in the script run as __main__" in runs_in_a_worker(_InMain())
    unpicklable = _InMain.__new__(_InMain)
    _InMain.__module__ = __name__
    unpicklable.lock = __import__("threading").Lock()
    assert "cannot be pickled" in runs_in_a_worker(None, unpicklable)
    assert runs_in_a_worker(None, None) is None
    tok = AutoTokenizer.from_pretrained(cfg.actor.model_path)
    with caplog.at_level(logging.WARNING, logger="arealite.trainer"):
        side = build.build_rollout(cfg, tok, build.make_loader(cfg, list(ITEMS), 0, 1), 1, unpicklable, None)
    assert isinstance(side, LocalRollout) and side.workflow is unpicklable
    assert "rollout.worker=thread" in caplog.text


def test_placement_moves_the_worker_to_the_trainers_cores_when_the_trainer_waits():
    cpus = sorted(os.sched_getaffinity(0))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.sched_setaffinity(child.pid, {cpus[0]})
        busy = CoreMigration(child.pid, set(cpus), window=3, warmup=1, threshold=0.1)
        for _ in range(4):  # warm-up + a window in which the trainer never waits
            busy.observe(0.0, 1.0)
        assert not busy.moved and os.sched_getaffinity(child.pid) == {cpus[0]}
        for _ in range(3):  # then a window in which it waits half the time: move, for good
            busy.observe(0.5, 1.0)
        assert busy.moved and os.sched_getaffinity(child.pid) == set(cpus)
        os.sched_setaffinity(child.pid, {cpus[0]})
        for _ in range(6):
            busy.observe(0.9, 1.0)
        assert os.sched_getaffinity(child.pid) == {cpus[0]}  # one move only
    finally:
        child.kill()
        child.wait()
