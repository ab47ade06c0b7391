"""A LoRA run end to end: `python -m arealite.train` with `actor.lora`, the launcher, a strict
embedded server, 2 trainer ranks each with its rollout worker process, a KL term against
the adapter-off reference, then a resume.

What it proves beyond the unit tests: every rank's generating client (in its own worker
process, told nothing by the push) samples with the adapter the trainer holds, only the
adapter travels, and a resumed run reloads it on a fresh server.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _train(demo: Path, runs: Path, steps: int) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "arealite.train", "--config", "examples/reverse_digits/config.yaml",
        f"experiment.output_root={runs}", "experiment.trial=lora",
        f"actor.model_path={demo / 'model'}", f"data.train_path={demo / 'train.jsonl'}",
        f"data.eval_path={demo / 'eval.jsonl'}", f"data.max_train_steps={steps}",
        "launch.n_trainer_procs=2", "rollout.worker=process",
        "rollout.consumer_batch_size=4", "generation.n_samples=4",
        # Partial credit that varies between samples: the tiny warm-up rarely reverses, and the
        # adapter must move for the test to tell its weights from the base model's.
        "data.reward_fn=user_pkg.rewards:digit_share",
        # Synchronous: the behaviour log-probs of a batch come from the version the trainer
        # recomputes, so any gap between them is a client sampling with other weights.
        "rollout.max_head_offpolicyness=0",
        "actor.lora.rank=4", "actor.lora.alpha=8", "actor.optimizer.lr=2e-2", "algorithm.kl_coef=0.01",
        "evaluation.freq_steps=100", "saver.freq_steps=2", "saver.export_merged_at_end=true",
        "stats.progress_bar=false", "stats.plot=false",
    ]
    return subprocess.run(cmd, cwd=REPO, env=run_env(REPO / "tests"), timeout=600, capture_output=True, text=True)


def _steps(run: Path) -> list[dict]:
    records = [json.loads(line) for line in (run / "stats.jsonl").read_text().splitlines()]
    return [r for r in records if "rollout/reward_mean" in r]


def test_lora_run_samples_with_the_trained_adapter_and_resumes(micro_demo_dir, tmp_path):
    from safetensors import safe_open

    runs = tmp_path / "runs"
    run = runs / "reverse_digits" / "lora"
    res = _train(micro_demo_dir, runs, steps=3)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    steps = _steps(run)
    assert [r["step"] for r in steps] == [1, 2, 3]

    with safe_open(str(run / "final_model" / "adapter_model.safetensors"), "pt") as f:
        adapter_bytes = sum(f.get_tensor(k).numel() * 4 for k in f.keys())
    with safe_open(str(micro_demo_dir / "model" / "model.safetensors"), "pt") as f:
        model_bytes = sum(f.get_tensor(k).numel() * 4 for k in f.keys())
    for r in steps:
        assert r["weight_sync/bytes"] == adapter_bytes < model_bytes / 4  # only the adapter travels
        assert r["weight_sync/probe_max_abs_diff"] <= 1e-5  # the servers score as the trainer
        # The rollouts of every rank were sampled with the adapter the trainer had.
        assert r["train/logp_mismatch_max"] <= 1e-4, r
        assert r["rollout/staleness_max"] == 0
        assert r["train/kl_ref"] >= 0 and "train/grad_norm" in r
    assert all(r["train/grad_norm"] > 0 for r in steps)
    assert steps[-1]["train/kl_ref"] > 0  # the adapter moved away from the reference (adapters off)
    assert (run / "final_model" / "adapter_config.json").is_file()
    merged = run / "final_model_merged"  # saver.export_merged_at_end: a plain HF model, no adapter
    with safe_open(str(merged / "model.safetensors"), "pt") as f:
        assert not any("lora" in k for k in f.keys()) and len(list(f.keys())) > 0

    res2 = _train(micro_demo_dir, runs, steps=4)
    assert res2.returncode == 0, res2.stdout[-3000:] + res2.stderr[-3000:]
    assert "resumed from" in res2.stdout + res2.stderr
    after = [r for r in _steps(run) if r["step"] == 3][-1:]  # the resumed run retakes step 3
    assert after and after[0]["train/logp_mismatch_max"] <= 1e-4
    assert [r["step"] for r in _steps(run)][-2:] == [3, 4]
