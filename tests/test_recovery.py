"""Checkpoint and recovery of a killed run: atomic checkpoints, recover.mode, checkpoints
by steps and by seconds, and exact per-prompt accounting across kills (SIGKILL before,
during and after a checkpoint write, and from outside at a random moment) of the real
launcher + torchrun trainer + embedded server.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from conftest import REPO, free_port, run_env

from arealite.config.schema import RecoverConfig, RolloutConfig, SaverConfig
from arealite.data.dataset import StatefulDataLoader
from arealite.server.process import ServerProcess
from arealite.trainer.checkpoint import Checkpointer, fault_point
from arealite.utils import accounting
from arealite.utils.accounting import EpochTagged, prompt_accounting
from arealite.utils.checkpoint_manifest import complete_checkpoints
from arealite.utils.procs import trainer_workers
from arealite.workflow.common import item_fields


def _env(**extra: str) -> dict[str, str]:
    return run_env(**extra)


# ------------------------------------------------------------ accounting (pure)


def _write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _step(step: int, ids: list[int], epoch: int = 0, **kw) -> dict:
    return {"step": step, accounting.IDS: ids, accounting.EPOCHS: [epoch] * len(ids), **kw}


def test_accounting_supersedes_a_killed_runs_later_steps(tmp_path):
    stats = tmp_path / "stats.jsonl"
    _write(stats, [
        {"step": 0, accounting.START: 0},
        _step(1, [0, 1]), _step(2, [2, 3]), _step(3, [4, 5]),  # killed after step 3, checkpoint at 2
        {"step": 2, accounting.START: 2},
        _step(3, [4, 5]),  # step 3 re-done; the killed run's step 3 no longer counts
        _step(4, [6, 7]),
        {"step": 4, accounting.END: 4, accounting.UNFINISHED_IDS: [0], accounting.UNFINISHED_EPOCHS: [1],
         accounting.EPOCHS_DONE: 1},
    ])
    acc = prompt_accounting(stats, expected_ids=range(8))
    assert acc.runs == 2 and acc.finished and acc.steps == [1, 2, 3, 4]
    e0 = acc.epochs[0]
    assert e0.exact and e0.trained == 8 and e0.handed_out
    assert acc.epochs[1].unfinished == [0] and acc.epochs[1].handed_out is False


def test_accounting_reports_duplicates_missing_dropped_and_skips_torn_lines(tmp_path):
    stats = tmp_path / "stats.jsonl"
    _write(stats, [
        {"step": 0, accounting.START: 0},
        _step(1, [0, 1]),
        _step(2, [1, 2], **{accounting.DROPPED_IDS: [3], accounting.DROPPED_EPOCHS: [0]}),
        {"step": 2, accounting.END: 2, accounting.EPOCHS_DONE: 1},
    ])
    with open(stats, "a") as f:
        f.write('{"step": 3, "rollout/prompt_ids": [7')  # torn by a kill
    acc = prompt_accounting(stats, expected_ids=range(6))
    e0 = acc.epochs[0]
    assert e0.duplicated == [1] and e0.missing == [4, 5] and e0.dropped == [3] and not e0.exact
    assert acc.steps == [1, 2]
    # A run that started over (recover.mode=disabled) supersedes everything after its start.
    with open(stats, "a") as f:
        f.write("\n" + json.dumps({"step": 0, accounting.START: 0}) + "\n" + json.dumps(_step(1, [5])) + "\n")
    acc = prompt_accounting(stats)
    assert acc.steps == [1] and not acc.finished and acc.epochs[0].trained == 1


def test_epoch_items_keep_their_epoch_through_pickle_and_stay_out_of_reward_kwargs():
    loader = EpochTagged(StatefulDataLoader([{"prompt": f"p{i}", "prompt_id": i} for i in range(6)], 2, seed=3))
    first = [b for b in loader]
    second = next(iter(loader))
    assert [it.epoch for b in first for it in b] == [0] * 6 and {it.epoch for it in second} == {1}
    assert sorted(it["prompt_id"] for b in first for it in b) == list(range(6))
    back = pickle.loads(pickle.dumps(second[0]))
    assert back.epoch == 1 and back == second[0] and "epoch" not in item_fields(back)
    assert loader.epochs_handed_out() == 1  # epoch 0 fully handed out, epoch 1 started
    fields = accounting.step_fields(second, [])
    assert fields[accounting.EPOCHS] == [1, 1] and len(fields[accounting.IDS]) == 2


def test_fault_spec_is_validated(monkeypatch):
    monkeypatch.setenv("AREALITE_FAULT", "ckpt_wirte:3")
    with pytest.raises(ValueError, match="point:step"):
        fault_point("ckpt_write", 3)
    monkeypatch.setenv("AREALITE_FAULT", "ckpt_write:3@1")  # another rank, another step: no effect
    fault_point("ckpt_write", 3)
    fault_point("ckpt_write", 4)


# ----------------------------------------- checkpointer with a real engine, in process


class _Parts:
    """A real FSDP engine (a world of one), a real controller (not started) and a dataloader."""

    def __init__(self, model_dir: Path):
        from arealite.config.schema import ActorConfig
        from arealite.rollout.controller import RolloutController
        from arealite.train_engine.fsdp import FSDPEngine

        self.engine = FSDPEngine(ActorConfig(model_path=str(model_dir))).initialize(total_steps=10)
        self.controller = RolloutController(None, RolloutConfig(consumer_batch_size=2))
        self.loader = EpochTagged(StatefulDataLoader([{"prompt": "p", "prompt_id": i} for i in range(8)], 2))


@pytest.fixture(scope="module")
def parts(micro_model_dir):
    p = _Parts(micro_model_dir)
    yield p
    p.engine.destroy()


def _ckpt(root: Path, keep_last: int = 2, mode: str = "auto") -> Checkpointer:
    return Checkpointer(root, SaverConfig(freq_steps=1, keep_last=keep_last), RecoverConfig(mode=mode))


def test_checkpoints_are_atomic_pruned_and_resume_the_rollout_state(parts, tmp_path):
    root = tmp_path / "ckpt"
    ck = _ckpt(root)
    it = iter(parts.loader)
    for step in (1, 2, 3):
        next(it)
        state = parts.controller.state_dict()
        state["counters"]["consumed"] = 2 * step
        parts.controller.load_state_dict(state)
        assert ck.maybe_save(step, parts.engine, parts.controller, parts.loader) == root / f"step_{step}"
    assert [s for s, _ in complete_checkpoints(root)] == [2, 3]  # keep_last=2
    manifest = json.loads((root / "step_3" / "COMPLETE").read_text())
    assert "rollout_rank0.pt" in manifest["files"] and "engine/.metadata" in manifest["files"]
    # Leftovers of a killed writer, and look-alikes that are not complete, never count.
    (root / "step_9.tmp").mkdir()
    (root / "step_8.trash").mkdir()
    (root / "step_7").mkdir()  # no manifest
    (root / "step_5").mkdir()
    (root / "step_5" / "COMPLETE").write_text(json.dumps({"files": ["rollout_rank0.pt"]}))  # listed file absent
    assert ck.latest()[0] == 3

    fresh = _Parts.__new__(_Parts)
    from arealite.rollout.controller import RolloutController

    fresh.controller = RolloutController(None, RolloutConfig(consumer_batch_size=2))
    fresh.loader = EpochTagged(StatefulDataLoader([{"prompt": "p", "prompt_id": i} for i in range(8)], 2))
    assert _ckpt(root).maybe_resume(parts.engine, fresh.controller, fresh.loader) == 3
    assert fresh.loader.state_dict()["index"] == 3 and fresh.controller.stats()["consumed"] == 6
    assert parts.engine.get_version() == 3
    assert not (root / "step_9.tmp").exists() and not (root / "step_8.trash").exists()  # swept on resume


def test_recover_modes(parts, tmp_path):
    root = tmp_path / "ckpt"
    with pytest.raises(FileNotFoundError, match="recover.mode=required"):
        _ckpt(root, mode="required").check_mode()
    with pytest.raises(FileNotFoundError, match="recover.mode=auto"):
        _ckpt(root, mode="required").maybe_resume(parts.engine, parts.controller, parts.loader)
    assert _ckpt(root).maybe_resume(parts.engine, parts.controller, parts.loader) == 0  # auto, nothing there
    for step in (4, 6):
        _ckpt(root).save(step, parts.engine, parts.controller, parts.loader)
    # disabled: starts at 0 and moves the old checkpoints aside, so that they neither get
    # resumed later nor make keep_last delete the new run's lower-numbered checkpoints.
    off = _ckpt(root, mode="disabled")
    assert off.maybe_resume(parts.engine, parts.controller, parts.loader) == 0
    assert complete_checkpoints(root) == []
    aside = [p for p in root.iterdir() if p.name.startswith("superseded_")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["step_4", "step_6"]
    off.save(2, parts.engine, parts.controller, parts.loader)
    assert [s for s, _ in complete_checkpoints(root)] == [2]
    assert _ckpt(root, mode="required").maybe_resume(parts.engine, parts.controller, parts.loader) == 2


def test_checkpoints_by_seconds(parts, tmp_path):
    """saver.freq_secs: due once that many seconds have passed since the start or the last save
    (a real clock: the Checkpointer takes none from outside)."""
    root = tmp_path / "ckpt"
    ck = Checkpointer(root, SaverConfig(freq_secs=1.0), RecoverConfig())
    assert not ck.due(1)
    time.sleep(1.0)
    assert ck.due(2)
    assert ck.maybe_save(2, parts.engine, parts.controller, parts.loader) == root / "step_2"
    assert not ck.due(3), "the clock starts again at every save"
    assert ck.maybe_save(3, parts.engine, parts.controller, parts.loader) is None
    both = Checkpointer(root, SaverConfig(freq_steps=4, freq_secs=3600), RecoverConfig())
    assert both.due(4) and not both.due(5), "with freq_steps set too, either one makes a save due"


_KILL_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[3])
from pathlib import Path
from test_recovery import _Parts, _ckpt
p = _Parts(Path(sys.argv[1]))
ck = _ckpt(Path(sys.argv[2]), keep_last=1)
for step in range(1, 5):
    ck.save(step, p.engine, p.controller, p.loader)
"""


@pytest.mark.parametrize("fault, latest, left", [
    ("ckpt_write:3", 2, {"step_2", "step_3.tmp"}),  # shards written, not yet renamed: step 3 does not exist
    ("ckpt_renamed:3", 3, {"step_2", "step_3"}),  # renamed, killed before the cleanup: step 3 is good
])
def test_killed_inside_a_checkpoint_write(micro_model_dir, tmp_path, fault, latest, left):
    root = tmp_path / "ckpt"
    res = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, str(micro_model_dir), str(root), str(REPO / "tests")],
                         cwd=REPO, env=_env(AREALITE_FAULT=fault), capture_output=True, text=True, timeout=120)
    assert res.returncode == -signal.SIGKILL, res.stdout + res.stderr
    assert {p.name for p in root.iterdir()} == left
    ck = _ckpt(root, keep_last=1)
    assert ck.latest()[0] == latest
    ck.sweep()  # what the next run does first
    assert {p.name for p in root.iterdir()} == {f"step_{latest}"}


# ------------------------------------------------ the real run: kill it, re-run it

STEPS, BATCH, N_PROMPTS, ETA = 16, 8, 64, 2  # 8 steps per epoch: two epochs
FREQ = 2  # saver.freq_steps


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    subprocess.run(
        [sys.executable, "examples/reverse_digits/prepare.py", "--out", str(out), "--size", "micro",
         "--n-train", str(N_PROMPTS), "--n-eval", "8", "--warmup-steps", "5", "--batch-size", "16"],
        cwd=REPO, env=_env(), check=True, timeout=300, capture_output=True,
    )
    return out


def _args(demo_dir: Path, runs: Path, *overrides: str) -> list[str]:
    return [
        "--config", "examples/reverse_digits/config.yaml",
        f"experiment.output_root={runs}", "experiment.trial=recovery",
        f"actor.model_path={demo_dir / 'model'}", f"data.train_path={demo_dir / 'train.jsonl'}",
        "data.eval_path=null", "evaluation.freq_steps=null", "evaluation.max_prompts=null",
        "launch.n_trainer_procs=2", f"rollout.consumer_batch_size={BATCH}", "generation.n_samples=2",
        f"rollout.max_head_offpolicyness={ETA}", f"saver.freq_steps={FREQ}", "saver.keep_last=2",
        "saver.export_hf_at_end=false", f"data.max_train_steps={STEPS}", "stats.progress_bar=false",
        "stats.plot=false", *overrides,
    ]


@pytest.fixture(scope="module")
def demo_server(demo_dir, tmp_path_factory) -> Iterator[str]:
    """One embedded server that outlives every killed trainer (as servers do on a cluster);
    the runs use it with ``launch.n_servers=0``. It saves a server start (a third of a
    launch) per run."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    with ServerProcess(demo_dir / "model", free_port(), log_path=log, env=_env()) as server:
        yield server.wait_healthy().url.removeprefix("http://")


def _launch(demo_dir: Path, runs: Path, log: Path, server: str, fault: str = "") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "arealite.launcher.local", "examples/rlvr/train.py",
           *_args(demo_dir, runs, "launch.n_servers=0")]
    env = _env(AREALITE_SERVER_ADDRS=server, AREALITE_FAULT=fault)  # an empty AREALITE_FAULT: no fault
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _run_records(stats: Path, run_index: int = -1) -> list[dict]:
    """The records of one run (from its start record to the next; the latest by default).

    Empty when that run has not written its start record yet (``run_index`` past the end).
    """
    if not stats.exists():
        return []
    recs = [json.loads(line) for line in stats.read_text().splitlines() if line.strip().endswith("}")]
    starts = [i for i, r in enumerate(recs) if accounting.START in r]
    if not starts or run_index >= len(starts):
        return []
    begin = starts[run_index]
    later = [i for i in starts if i > begin]
    return recs[begin:later[0]] if later else recs[begin:]


@pytest.mark.slow
def test_killed_runs_resume_and_train_every_prompt_exactly_once(demo_dir, demo_server, tmp_path):
    runs = tmp_path / "runs"
    run = runs / "reverse_digits" / "recovery"
    stats, ckpts = run / "stats.jsonl", run / "checkpoints"
    seed = int(os.environ.get("AREALITE_TEST_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)

    # Killed by itself (rank 0, the one that renames) before, during and after writing a
    # checkpoint, each at a random checkpoint step, each run resuming before the next one's
    # kill point: (AREALITE_FAULT, the step the next run resumes from, the checkpoints left).
    before = rng.choice([2 * FREQ, 3 * FREQ])
    during = rng.choice([before, before + FREQ])
    after = rng.choice([during, during + FREQ])
    faults = [
        # its stats record written, its checkpoint not: resumes from the one before
        (f"step:{before}", before - FREQ, [before - 2 * FREQ, before - FREQ]),
        # every rank's shards on disk, not renamed: step_N.tmp, which does not count
        (f"ckpt_write:{during}", during - FREQ, [during - 2 * FREQ, during - FREQ, f"{during}.tmp"]),
        # renamed, the old ones not yet pruned: it counts
        (f"ckpt_renamed:{after}", after, [after - 2 * FREQ, after - FREQ, after]),
    ]
    # Then SIGKILLed from outside at a random moment after a random step.
    target = rng.randint(after + 1, after + 2 * FREQ)
    why = (f"(kills at {[f for f, _, _ in faults]}, then after step {target}; random seed {seed}: "
           f"AREALITE_TEST_SEED={seed} repeats it)")
    print(why)

    def trainer_log() -> str:
        return (run / "logs" / "trainer.log").read_text()

    def out(log: Path) -> str:
        return log.read_text()[-3000:] + trainer_log()[-3000:]

    def check_resumed(log: Path, step: int | None) -> None:
        if step is not None:  # None: the first run, which starts fresh
            assert f"resumed from {ckpts / f'step_{step}'} (step {step})" in log.read_text(), f"{out(log)} {why}"

    resume_at = None
    for i, (fault, next_resume_at, left) in enumerate(faults):
        log = tmp_path / f"run{i}.log"
        p = _launch(demo_dir, runs, log, demo_server, fault=fault)
        assert p.wait(300) != 0, f"{out(log)} {why}"
        check_resumed(log, resume_at)
        assert f"kills itself at {fault}" in trainer_log(), f"{out(log)} {why}"
        assert {d.name for d in ckpts.iterdir()} == {f"step_{s}" for s in left if s != 0}, f"{out(log)} {why}"
        resume_at = next_resume_at

    log = tmp_path / "run_sigkill.log"
    p = _launch(demo_dir, runs, log, demo_server)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and p.poll() is None:
            # Only this run's steps count: until it writes its start record, the records on
            # disk are the previous run's, which may already have gone past the target.
            done = [r["step"] for r in _run_records(stats, run_index=len(faults)) if accounting.IDS in r]
            if done and max(done) >= target:
                break
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))  # somewhere before, during or after the next checkpoint
        workers = trainer_workers(p.pid)
        assert workers, f"no trainer workers found {why}\n" + out(log)
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        assert p.wait(120) != 0, f"the run was not killed {why}\n" + out(log)
    finally:
        if p.poll() is None:
            p.kill()
    check_resumed(log, resume_at)

    # The same command again: it finishes.
    log = tmp_path / "run_last.log"
    p = _launch(demo_dir, runs, log, demo_server)
    assert p.wait(300) == 0, f"{out(log)} {why}"
    assert "resumed from" in log.read_text(), out(log)

    acc = prompt_accounting(stats, expected_ids=range(N_PROMPTS))
    assert acc.runs == len(faults) + 2 and acc.finished and acc.steps == list(range(1, STEPS + 1)), why
    for ep, rep in acc.epochs.items():
        assert rep.duplicated == [], f"epoch {ep}: prompts trained more than once: {rep.duplicated} {why}"
    for ep in (0, 1):  # 16 steps x 8 prompts: both epochs handed out, every prompt exactly once
        rep = acc.epochs[ep]
        assert rep.handed_out and rep.exact and rep.dropped == [], f"epoch {ep}: {rep} {why}"
    assert sum(r.trained for r in acc.epochs.values()) == STEPS * BATCH
    # Work was really re-done, and the staleness bound held in every run, from its first step
    # after the resume on.
    all_steps = [json.loads(line) for line in stats.read_text().splitlines() if accounting.IDS in line]
    assert len(all_steps) > STEPS, f"nothing was re-done {why}"
    for r in all_steps:
        assert r["rollout/staleness_max"] <= ETA and len(r[accounting.IDS]) == BATCH, f"{r} {why}"
    assert {d.name for d in ckpts.iterdir()} == {"step_14", "step_16"}  # no .tmp/.trash left


@pytest.mark.slow
def test_required_mode_without_checkpoint_fails_before_starting(demo_dir, tmp_path):
    """The training script itself (no servers needed): it stops before building any engine."""
    res = subprocess.run(
        [sys.executable, "examples/rlvr/train.py", *_args(demo_dir, tmp_path / "runs", "recover.mode=required")],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert res.returncode != 0
    assert "recover.mode=required but there is no complete checkpoint" in res.stderr, res.stderr[-3000:]
    assert "recover.mode=auto" in res.stderr
