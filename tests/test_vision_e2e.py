"""Trainer and server log-probs agree with images (issue 33, part 5): a synchronous run
(``max_head_offpolicyness: 0``) of the tiny Qwen2.5-VL in fp32 on CPU through the whole stack
(launcher, embedded server running the VLM, one trainer process). At every step the trainer
recomputes the batch's log-probs (``prox_logp``: decoupled PPO over two mini-batches) on the
weights the server sampled with, and the step logs the largest difference from the server's
behaviour log-probs over the trained tokens (``logp_mismatch_max_batch``, `PPOActor.ppo_update`).
Every row has an image (on several trainer ranks a micro-batch with images on one rank and none
on another is refused, docs/vision.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from conftest import run_env

pytestmark = pytest.mark.slow


def test_trainer_and_server_logprobs_agree_every_step_with_images(tmp_path):
    from PIL import Image

    from arealite.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "vl-micro", size="vl-micro", seed=0)
    (tmp_path / "images").mkdir()
    rows = []
    for i, (size, colour) in enumerate([((56, 56), (220, 0, 0)), ((56, 84), (0, 90, 255)),
                                        ((84, 56), (0, 170, 0)), ((56, 56), (200, 200, 0))]):
        Image.new("RGB", size, colour).save(tmp_path / "images" / f"{i}.png")
        rows.append({"prompt": "<image> Which colour?", "answer": str(i + 1), "images": [f"images/{i}.png"]})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # The random model never answers right: reward the sum of the sampled token ids, so that a
    # group's samples differ unless they are the same tokens and the second step samples from
    # updated weights. (The parity of the first token sometimes tied every group of a step:
    # all advantages zero, a zero gradient, and this test failed now and then.)
    (tmp_path / "parity_reward.py").write_text(
        "def reward(prompt, completion, prompt_ids, completion_ids, answer, **_):\n"
        "    return float(sum(completion_ids)) / 1000.0\n")
    runs = tmp_path / "runs"
    cfg = {
        "experiment": {"name": "vl", "trial": "sync", "output_root": str(runs)},
        "launch": {"n_servers": 1, "n_trainer_procs": 1},
        "server": {"dtype": "float32"},
        "rollout": {"consumer_batch_size": 2, "max_head_offpolicyness": 0},
        "generation": {"n_samples": 2, "max_new_tokens": 4, "temperature": 1.0},
        "actor": {"model_path": str(model), "dtype": "float32",
                  "optimizer": {"lr": 1e-3, "warmup_steps": 0, "lr_scheduler": "constant"}},
        "algorithm": {"adv_estimator": "grpo", "use_decoupled_loss": True, "n_minibatches": 2, "kl_coef": 0.0},
        "data": {"train_path": str(tmp_path / "train.jsonl"), "reward_fn": "parity_reward:reward",
                 "apply_chat_template": True, "image_key": "images", "max_train_steps": 2},
        "saver": {"export_hf_at_end": False},
        "stats": {"progress_bar": False, "plot": False},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    res = subprocess.run([sys.executable, "-m", "arealite.train", "--config", str(tmp_path / "cfg.yaml")],
                         cwd=tmp_path, env=run_env(tmp_path), capture_output=True, text=True, timeout=500, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = [json.loads(x) for x in (runs / "vl" / "sync" / "stats.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    diffs = [r["train/logp_mismatch_max_batch"] for r in steps]
    print("max |trainer - server| log-prob per step:", diffs)
    assert all(0 <= d <= 1e-4 for d in diffs), diffs
    # The weights moved between the steps (the second step's server ran the pushed weights).
    assert all(r["train/grad_norm"] > 0 for r in steps), steps
