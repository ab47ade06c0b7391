"""The library trainer end to end: a user's workflow, advantage estimator and policy loss,
defined outside the package and named in a YAML file, trained by one command with no
script; and a script that hands the trainer a workflow object and hooks.

Real processes: the launcher, an embedded server, torchrun with gloo, HTTP on 127.0.0.1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import REPO, run_env

pytestmark = pytest.mark.slow
TESTS = Path(__file__).resolve().parent


def _env(**extra: str) -> dict[str, str]:
    return run_env(TESTS, **extra)


@pytest.fixture(scope="module")
def demo_dir(micro_demo_dir) -> Path:
    return micro_demo_dir


def _config(demo_dir: Path, runs: Path, **sections) -> dict:
    cfg = {
        "experiment": {"name": "user", "trial": "t", "output_root": str(runs)},
        "launch": {"n_servers": 1, "n_trainer_procs": 2},
        "rollout": {"consumer_batch_size": 4, "max_head_offpolicyness": 1},
        "generation": {"n_samples": 4, "max_new_tokens": 8},
        "actor": {"model_path": str(demo_dir / "model")},
        "data": {"train_path": str(demo_dir / "train.jsonl"), "eval_path": str(demo_dir / "eval.jsonl"),
                 "reward_fn": "arealite.reward.reverse_digits:reverse_digits_reward", "max_train_steps": 3},
        "saver": {"export_hf_at_end": False},
        "stats": {"progress_bar": False},
        "weight_sync": {"bucket_size_mb": 0.05},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_workflow_estimator_and_loss_from_yaml_train_with_one_command(demo_dir, tmp_path):
    runs, trace = tmp_path / "runs", tmp_path / "trace.txt"
    cfg = _config(demo_dir, runs,
                  rollout={"workflow": "user_pkg.reverse:ReverseWorkflow", "workflow_kwargs": {"length_bonus": 0.25}},
                  algorithm={"adv_estimator": "user_pkg.reverse:centered_advantages",
                             "policy_loss": "user_pkg.reverse:clipped_reinforce_loss"})
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    res = subprocess.run([sys.executable, "-m", "arealite.train", "--config", str(tmp_path / "cfg.yaml")],
                         cwd=tmp_path, env=_env(USER_PKG_TRACE=str(trace)), capture_output=True, text=True,
                         timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    calls = trace.read_text().split("\n")
    for what in ("workflow", "advantage", "loss"):  # the user's code ran on both trainer ranks
        assert {f"{what} 0", f"{what} 1"} <= set(calls), (what, sorted(set(calls)))
    run = runs / "user" / "t"
    steps = [r for r in _records(run / "stats.jsonl") if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["rollout/n_trajectories"] == 16
        assert 0.0 < r["train/user_ratio_mean"] <= 1.2 + 1e-6  # the user's loss logged its own stat
        assert r["weight_sync/total_s"] > 0 and r["rollout/staleness_max"] <= 1
    assert (run / "reward_curve.png").stat().st_size > 1000
    assert (run / "logs" / "trainer.log").exists() and (run / "logs" / "server0.log").exists()
    # The evaluation copy of the user's workflow samples greedily, once per prompt.
    evals = [r for r in _records(run / "stats.jsonl") if "eval/accuracy" in r]
    assert len(evals) == 2 and all(r["eval/n"] == 8 for r in evals)


HOOK_SCRIPT = textwrap.dedent('''
    import json, os, sys
    from arealite.config.loader import parse_args
    from arealite.trainer import RLTrainer, TrainerHook
    from transformers import AutoTokenizer
    from user_pkg.reverse import ReverseWorkflow

    class Record(TrainerHook):
        def __init__(self, path):
            self.path = path
        def write(self, **kv):
            with open(self.path, "a") as f:
                f.write(json.dumps(kv) + "\\n")
        def on_train_start(self, trainer, step):
            self.write(event="start", step=step, rank=trainer.rank)
        def on_batch(self, trainer, step, batch):
            batch["rewards"] = batch["rewards"] * 0 + 1.0  # the hook reshapes the rewards
        def on_step_end(self, trainer, step, stats):
            self.write(event="step", step=step, reward=stats["rollout/reward_mean"], rank=trainer.rank)
        def on_train_end(self, trainer, stats):
            self.write(event="end", rank=trainer.rank, keys=sorted(stats))

    cfg = parse_args(sys.argv[1:])
    tok = AutoTokenizer.from_pretrained(cfg.actor.model_path)
    hook = Record(os.environ["HOOK_LOG"] + os.environ.get("RANK", "0"))
    RLTrainer(cfg, workflow=ReverseWorkflow(tok, cfg.generation), hooks=[hook]).train()
''')


def test_a_script_passes_a_workflow_object_and_hooks(demo_dir, tmp_path):
    runs, log = tmp_path / "runs", tmp_path / "hooks_rank"
    (tmp_path / "train.py").write_text(HOOK_SCRIPT)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(_config(
        demo_dir, runs, launch={"n_servers": 1, "n_trainer_procs": 1},
        data={"eval_path": None, "max_train_steps": 2}, stats={"progress_bar": False, "plot": False})))
    res = subprocess.run([sys.executable, "-m", "arealite.launcher.local", str(tmp_path / "train.py"),
                          "--config", str(tmp_path / "cfg.yaml")],
                         cwd=REPO, env=_env(HOOK_LOG=str(log)), capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    events = [json.loads(x) for x in (tmp_path / "hooks_rank0").read_text().splitlines()]
    assert [e["event"] for e in events] == ["start", "step", "step", "end"]
    assert [e["step"] for e in events[:3]] == [0, 1, 2]
    # The stats are taken after on_batch: the hook's rewards are what was trained on and logged.
    assert all(e["reward"] == 1.0 for e in events if e["event"] == "step")
    assert "data/epochs_handed_out" in events[-1]["keys"]  # the final record closes the accounting
