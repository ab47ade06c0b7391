"""A 20-line agent defined outside the package (tests/user_pkg/agent.py, written against the
OpenAI API only) trains by one command: launcher, embedded server, torchrun, the rollout
worker process serving the OpenAI-compatible endpoint on its controller's loop."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import run_env

pytestmark = pytest.mark.slow
TESTS = Path(__file__).resolve().parent


def test_an_openai_agent_trains_with_one_command(micro_demo_dir, tmp_path):
    runs, trace = tmp_path / "runs", tmp_path / "trace.txt"
    cfg = {
        "experiment": {"name": "agent", "trial": "t", "output_root": str(runs)},
        "launch": {"n_servers": 1, "n_trainer_procs": 2},
        "rollout": {"consumer_batch_size": 4, "max_head_offpolicyness": 1, "workflow": "agent",
                    "workflow_kwargs": {"run": "user_pkg.agent:run", "timeout_s": 120}},
        "generation": {"n_samples": 4, "max_new_tokens": 8},
        "actor": {"model_path": str(micro_demo_dir / "model")},
        "data": {"train_path": str(micro_demo_dir / "train.jsonl"), "eval_path": str(micro_demo_dir / "eval.jsonl"),
                 "max_train_steps": 2},
        "evaluation": {"max_prompts": 4},
        "saver": {"export_hf_at_end": False},
        "stats": {"progress_bar": False},
        "weight_sync": {"bucket_size_mb": 0.05},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    res = subprocess.run([sys.executable, "-m", "arealite.train", "--config", str(tmp_path / "cfg.yaml")],
                         cwd=tmp_path, env=run_env(TESTS, USER_PKG_TRACE=str(trace)), capture_output=True,
                         text=True, timeout=500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert {"agent 0", "agent 1"} <= set(trace.read_text().split("\n"))  # the agent ran on both ranks
    records = [json.loads(line) for line in (runs / "agent" / "t" / "stats.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/n_trajectories"] == 16  # 4 groups of 4 episodes, one conversation row each
        assert r["weight_sync/total_s"] > 0
    assert any("eval/accuracy" in r for r in records)
