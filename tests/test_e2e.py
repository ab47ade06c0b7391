"""End to end: the launcher, an embedded server, a 2-process torchrun FSDP2 trainer and
distributed weight sync run the demo's training script for a few steps, then resume it; the
one command runs a composed layout on 4 trainer ranks.

Everything is real: processes, HTTP on 127.0.0.1, gloo process groups, files.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_env

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    return run_env()


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    """The demo's model and data, with a very short warm-up (the pipeline, not learning, is under test)."""
    out = tmp_path_factory.mktemp("demo")
    subprocess.run(
        [sys.executable, "examples/reverse_digits/prepare.py", "--out", str(out), "--size", "micro",
         "--n-train", "200", "--n-eval", "16", "--warmup-steps", "10", "--batch-size", "16"],
        cwd=REPO, env=_env(), check=True, timeout=300, capture_output=True,
    )
    return out


def _launch(demo_dir: Path, runs: Path, *overrides: str, timeout: float = 400) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "arealite.launcher.local", "examples/rlvr/train.py",
        "--config", "examples/reverse_digits/config.yaml",
        f"experiment.output_root={runs}", "experiment.trial=e2e",
        f"actor.model_path={demo_dir / 'model'}", f"data.train_path={demo_dir / 'train.jsonl'}",
        f"data.eval_path={demo_dir / 'eval.jsonl'}", "launch.n_trainer_procs=2",
        "rollout.consumer_batch_size=4", "generation.n_samples=4", "evaluation.freq_steps=2",
        "saver.freq_steps=2", "stats.progress_bar=false", "weight_sync.bucket_size_mb=0.05",
        *overrides,
    ]
    return subprocess.run(cmd, cwd=REPO, env=_env(), timeout=timeout, capture_output=True, text=True)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "stats.jsonl").read_text().splitlines()]


def test_async_grpo_end_to_end_then_resume(demo_dir, tmp_path):
    runs = tmp_path / "runs"
    run = runs / "reverse_digits" / "e2e"
    res = _launch(demo_dir, runs, "data.max_train_steps=3")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout + res.stderr
    assert "held-out greedy accuracy: before RL" in out

    records = _records(run)
    steps = [r for r in records if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        # 4 groups x 4 samples over 2 ranks, each group one prompt
        assert r["rollout/n_trajectories"] == 16
        assert r["rollout/staleness_max"] <= 2  # the configured bound
        assert r["weight_sync/n_buckets"] > 1  # several buckets per push
        assert r["weight_sync/n_tensors"] > 0
        for key in ("train/grad_norm", "train/lr", "train/entropy", "train/logp_mismatch_mean",
                    "time/rollout_wait_s", "time/weight_sync_s", "perf/train_tokens_per_s",
                    "controller/output_queue"):
            assert key in r, key
    assert any("eval/accuracy" in r for r in records)
    assert (run / "reward_curve.png").stat().st_size > 1000
    assert (run / "final_model" / "model.safetensors").exists()
    assert (run / "logs" / "server0.log").exists() and (run / "logs" / "trainer.log").exists()
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step_2"], ckpts  # step 3 is not a multiple of freq_steps; no .tmp left

    # Re-running the same command with a larger budget resumes from step 2.
    res2 = _launch(demo_dir, runs, "data.max_train_steps=4")
    assert res2.returncode == 0, res2.stdout[-3000:] + res2.stderr[-3000:]
    assert "resumed from" in res2.stdout + res2.stderr
    records2 = _records(run)[len(records):]
    assert [r["step"] for r in records2 if "rollout/reward_mean" in r] == [3, 4]


def test_a_composed_layout_trains_through_the_one_command(demo_dir, tmp_path):
    """`python -m arealite.train` with 4 trainer ranks as one sequence x tensor-parallel group
    (sp=2 x tp=2; the demo's model has 2 KV heads, fewer than the 4 ranks): rollouts, training,
    distributed weight pushes gathered from every layout's shards, the final export, for 2 steps."""
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "arealite.train", "--config", "examples/reverse_digits/config.yaml",
           f"experiment.output_root={runs}", "experiment.trial=e2e", f"actor.model_path={demo_dir / 'model'}",
           f"data.train_path={demo_dir / 'train.jsonl'}", f"data.eval_path={demo_dir / 'eval.jsonl'}",
           "launch.n_trainer_procs=4", "actor.sp_size=2", "actor.tp_size=2", "rollout.consumer_batch_size=4",
           "generation.n_samples=4", "evaluation.freq_steps=null", "stats.progress_bar=false",
           "weight_sync.bucket_size_mb=0.05", "data.max_train_steps=2"]
    res = subprocess.run(cmd, cwd=REPO, env=_env(), timeout=500, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = runs / "reverse_digits" / "e2e"
    steps = [r for r in _records(run) if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/n_trajectories"] == 16 and r["train/n_seqs"] == 16  # the group trains on all ranks' rows
        assert r["weight_sync/n_tensors"] > 0
    assert (run / "final_model" / "model.safetensors").exists()


def test_moe_run_with_routing_replay_completes(tmp_path):
    """A tiny Qwen3-MoE through the whole system with `algorithm.routing_replay: r3`: the servers
    record each token's experts, the client joins them across interrupted segments (the pushes
    pause the servers mid-generation), the trajectories carry them and the trainer's forwards
    replay them (a routing that does not line up with the packed tokens raises; a server started
    without `--enable-return-routed-experts` refuses the requests)."""
    demo = tmp_path / "demo_moe"
    subprocess.run(
        [sys.executable, "examples/reverse_digits/prepare.py", "--out", str(demo), "--size", "moe-micro",
         "--n-train", "200", "--n-eval", "16", "--warmup-steps", "10", "--batch-size", "16"],
        cwd=REPO, env=_env(), check=True, timeout=300, capture_output=True,
    )
    runs = tmp_path / "runs"
    res = _launch(demo, runs, "data.max_train_steps=2", "evaluation.freq_steps=null", "algorithm.routing_replay=r3")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    steps = [r for r in _records(runs / "reverse_digits" / "e2e") if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
