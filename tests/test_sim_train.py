"""The simulated train engine (``actor.backend: sim``): its cost model, its contract (versions,
checkpoints, the weights it pushes) and whole runs through ``python -m arealite.train`` on
simulated servers, one of them SIGKILLed and resumed."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
import yaml
from conftest import run_env

from arealite.config.schema import ArealiteConfig, SimTrainOptions
from arealite.sim.train_engine import (
    STATE_FILE,
    SimTrainEngine,
    step_seconds,
    train_gpu,
)
from arealite.trainer.build import build_train_engines
from arealite.utils import accounting
from arealite.utils.accounting import prompt_accounting


def test_a_step_takes_six_flops_per_parameter_and_token_over_the_cluster():
    h800 = train_gpu("h800")
    assert h800.peak_tflops == 989.0
    # 7.62e9 params x 1M tokens x 6 FLOPs over 8 GPUs at 40% of 989 TFLOP/s: ~14.4 s.
    s = step_seconds(1_000_000, 7.62, 6.0, h800, 8, 0.4)
    assert s == pytest.approx(6 * 7.62e9 * 1e6 / (0.4 * 989e12 * 8))
    assert step_seconds(1_000_000, 7.62, 6.0, h800, 16, 0.4) == pytest.approx(s / 2)
    with pytest.raises(ValueError, match="actor.sim.gpu='b300'"):
        train_gpu("b300")


def _batch(rows: int, length: int) -> dict[str, torch.Tensor]:
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[:, length // 2:] = 0  # right padding: half the positions are real tokens
    return {"input_ids": torch.arange(rows * length).view(rows, length), "attention_mask": mask,
            "logprobs": -torch.rand(rows, length)}


def test_the_engine_sleeps_its_scaled_time_and_keeps_its_state(tiny_model_dir, tmp_path):
    opts = SimTrainOptions(gpu="h100", model="7b", n_gpus=1, mfu=0.5)
    eng = SimTrainEngine(opts, str(tiny_model_dir), time_scale=0.01).initialize()
    batch = _batch(4, 100_000)  # 200k real tokens: 18.5 simulated s, 0.185 s real
    expect = step_seconds(200_000, 7.62, 6.0, train_gpu("h100"), 1, 0.5)
    t0 = time.perf_counter()
    stats = eng.train_batch(batch, loss_fn=None, loss_weight_fn=None)
    took = time.perf_counter() - t0
    assert stats["n_tokens"] == 200_000 and stats["sim_seconds"] == pytest.approx(expect)
    assert expect * 0.01 <= took < expect * 0.01 + 0.5
    out = eng.forward(batch, post_hook=None)
    assert torch.equal(out, batch["logprobs"])  # the simulated policy is the servers'
    assert eng.simulated_s == pytest.approx(expect * 4 / 3)

    eng.set_version(7)
    eng.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / STATE_FILE).stat().st_size < 10_000
    again = SimTrainEngine(opts, str(tiny_model_dir)).initialize()
    again.load(tmp_path / "ckpt")
    assert (again.get_version(), again.step_count, again.simulated_s) == (7, 1, eng.simulated_s)

    # The push reads the small model's tensors, all of them, in buckets.
    from safetensors.torch import load_file
    on_disk = load_file(str(tiny_model_dir / "model.safetensors"))
    pushed = {n: t for bucket in eng.named_weight_buckets(1 << 16) for n, t in bucket}
    assert pushed.keys() == on_disk.keys()
    eng.export_hf(tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file() and load_file(str(tmp_path / "hf" / "model.safetensors"))


def test_the_config_selects_it_and_refuses_what_it_cannot_simulate(tiny_model_dir):
    cfg = ArealiteConfig.model_validate({"actor": {"model_path": str(tiny_model_dir), "backend": "sim"},
                                         "algorithm": {"kl_coef": 0.1}})
    actor, ref = build_train_engines(cfg, total_steps=3)
    assert isinstance(actor, SimTrainEngine) and isinstance(ref, SimTrainEngine) and ref.frozen
    with pytest.raises(RuntimeError, match="frozen"):
        ref.train_batch(_batch(1, 4), None, None)
    cfg = ArealiteConfig.model_validate({"actor": {"model_path": str(tiny_model_dir), "backend": "sim",
                                                   "lora": {"rank": 4}}})
    with pytest.raises(ValueError, match="actor.lora: null"):
        build_train_engines(cfg, total_steps=3)


# ---------------------------------------------------------------- whole runs

STEPS, BATCH, FREQ = 6, 4, 2


def _run(demo, runs, tmp_path, fault: str = "") -> subprocess.CompletedProcess:
    cfg = {
        "experiment": {"name": "simtrain", "trial": "t", "output_root": str(runs)},
        "launch": {"n_servers": 2, "n_trainer_procs": 1, "server_backend": "sim"},
        "server": {"sim": {"time_scale": 0.01, "length_median": 6, "length_sigma": 0.5}},
        "rollout": {"consumer_batch_size": BATCH, "max_head_offpolicyness": 1},
        "generation": {"n_samples": 2, "max_new_tokens": 8},
        "actor": {"model_path": str(demo / "model"), "backend": "sim", "sim": {"n_gpus": 8}},
        "data": {"train_path": str(demo / "train.jsonl"), "eval_path": None,
                 "reward_fn": "arealite.reward.reverse_digits:reverse_digits_reward", "max_train_steps": STEPS},
        "evaluation": {"freq_steps": None},
        "saver": {"export_hf_at_end": False, "freq_steps": FREQ, "keep_last": 2},
        "stats": {"progress_bar": False},
        "weight_sync": {"bucket_size_mb": 0.05, "probe": False},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    env = run_env() | {"AREALITE_FAULT": fault}
    return subprocess.run([sys.executable, "-m", "arealite.train", "--config", str(tmp_path / "cfg.yaml")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400, check=False)


@pytest.mark.slow
def test_a_simulated_run_killed_mid_run_resumes_and_loses_nothing(micro_demo_dir, tmp_path):
    runs = tmp_path / "runs"
    run = runs / "simtrain" / "t"
    first = _run(micro_demo_dir, runs, tmp_path, fault="step:3")  # SIGKILL after step 3's record
    assert first.returncode != 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert (run / "checkpoints" / "step_2").is_dir()
    second = _run(micro_demo_dir, runs, tmp_path)
    out = second.stdout[-3000:] + second.stderr[-3000:]
    assert second.returncode == 0, out
    assert "resumed from" in (run / "logs" / "trainer.log").read_text() + out

    acc = prompt_accounting(run / "stats.jsonl", expected_ids=range(64))
    assert acc.runs == 2 and acc.finished and acc.steps == list(range(1, STEPS + 1))
    for ep, rep in acc.epochs.items():
        assert rep.duplicated == [], f"epoch {ep}: prompts trained more than once: {rep.duplicated}"
    assert sum(r.trained for r in acc.epochs.values()) == STEPS * BATCH
    recs = [json.loads(x) for x in (run / "stats.jsonl").read_text().splitlines() if accounting.IDS in x]
    assert all(r["weight_sync/total_s"] > 0 for r in recs)
    # The controller bounds how many groups start per version ((eta + v + 1) x batch), not the
    # order they finish in: a group admitted at version 0 that finishes after younger ones is
    # trained one step later than eta allows (seen at eta=1: staleness 2; docs/scale.md).
    assert all(r["rollout/staleness_max"] <= 2 for r in recs)
    # Versions continue where the checkpoint left them: the last one saved is at the last step.
    found = list((run / "checkpoints" / f"step_{STEPS}").rglob(STATE_FILE))
    assert found, sorted(map(str, (run / "checkpoints").rglob("*")))
    state = torch.load(found[0], weights_only=True)
    assert state["version"] == STEPS and state["step"] == STEPS
