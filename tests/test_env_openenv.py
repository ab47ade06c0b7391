"""OpenEnv environments as a workflow (`rollout.workflow: openenv`): a user's environment class
(tests/user_pkg/openenv_guess.py) served by openenv's own server, started as a local child
process on 127.0.0.1; reset/step over its protocol; the model's turns through the endpoint,
token-exact, observations masked; the steps' rewards as the episode's; a failing environment
costs its episode; and a run through `python -m arealite.train`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from transformers import AutoTokenizer

from conftest import ScriptedChat as Scripted
from conftest import run_env

pytest.importorskip("openenv.core")

from arealite.config.schema import GenerationConfig, RolloutConfig  # noqa: E402
from arealite.environments.openenv_env import OpenEnvWorkflow  # noqa: E402

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
GUESS = {"env_class": "user_pkg.openenv_guess:GuessEnv", "action_class": "user_pkg.openenv_guess:GuessAction",
         "observation_class": "user_pkg.openenv_guess:GuessObservation", "observation_key": "prompt"}


@pytest.fixture(scope="module")
def tok(micro_model_dir):
    return AutoTokenizer.from_pretrained(micro_model_dir)


@pytest.fixture(scope="module")
def workflows(tok):
    """Two workflows (reject / zero on errors) on one local server each; stopped at the end."""
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), old])  # the child server imports user_pkg
    made = {}
    try:
        for policy in ("reject", "zero"):
            made[policy] = OpenEnvWorkflow(**GUESS, tokenizer=tok, rollout=RolloutConfig(on_reward_error=policy),
                                           generation=GenerationConfig(n_samples=2, max_new_tokens=8), timeout_s=30)
        yield made
    finally:
        os.environ["PYTHONPATH"] = old
        for wf in made.values():
            wf.server.stop()


async def test_turns_until_done_rewards_summed_observations_masked(tok, workflows):
    wf = workflows["reject"]
    model = Scripted(tok, ["5", "7", "3"])  # seed 3: the digit is 3, guessed on the third turn
    td = await wf.arun_episode(model, {"prompt": "episode 3", "prompt_id": 3, "reset": {"seed": 3}})
    assert td["input_ids"].shape[0] == 2 and wf.stats()["env_errors"] == 0
    # Each episode is one row of its turns (its guesses trained, the observations context) until
    # the right digit or the third guess; its reward is the sum of the steps' rewards.
    for row in range(2):
        ids, mask = td["input_ids"][row].tolist(), td["loss_mask"][row].tolist()
        digits = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=True)
        context = tok.decode([t for t, m in zip(ids, mask) if not m], skip_special_tokens=True)
        assert "Guess my digit." in context and all(d in "573" for d in digits)
        assert digits.endswith("3") or len(digits) == 3
        assert context.count("Guess again.") == len(digits) - 1
        assert td["rewards"][row].item() == pytest.approx(sum(1.0 if d == "3" else 0.05 for d in digits))
    assert wf.stats()["agent_rerendered"] == 0  # every turn continued the last one, token-exact


async def test_an_environment_that_raises_costs_its_episode(tok, workflows):
    wf = workflows["reject"]
    before = wf.stats()["env_errors"]
    assert await wf.arun_episode(Scripted(tok, ["RAISE"]), {"prompt": "e", "prompt_id": 0, "reset": {"seed": 1}}) is None
    assert wf.stats()["env_errors"] == before + 2 and wf.stats()["env_rejected_groups"] == 1
    zero = workflows["zero"]
    td = await zero.arun_episode(Scripted(tok, ["RAISE"]), {"prompt": "e", "prompt_id": 0, "reset": {"seed": 1}})
    assert td["rewards"].tolist() == [0.0, 0.0] and zero.stats()["env_errors"] == 2


def test_settings_are_checked(tok):
    gen = GenerationConfig()
    with pytest.raises(ValueError, match="url .* or env_class"):
        OpenEnvWorkflow(tokenizer=tok, generation=gen)
    with pytest.raises(ValueError, match="rollout.workflow_kwargs.action_class is needed"):
        OpenEnvWorkflow(env_class=GUESS["env_class"], tokenizer=tok, generation=gen)
    with pytest.raises(ImportError, match="rollout.workflow_kwargs.env_class"):
        OpenEnvWorkflow(**{**GUESS, "env_class": "no_such_pkg:Env"}, tokenizer=tok, generation=gen)


@pytest.mark.slow
def test_an_openenv_environment_trains_through_one_command(micro_model_dir, tmp_path):
    cfg = {
        "experiment": {"name": "oe", "trial": "t", "output_root": str(tmp_path / "runs")},
        "launch": {"n_servers": 1, "n_trainer_procs": 1},
        "rollout": {"consumer_batch_size": 4, "max_head_offpolicyness": 1, "workflow": "openenv",
                    "workflow_kwargs": {**GUESS, "max_turns": 2, "n_items": 16, "n_eval_items": 4, "timeout_s": 120}},
        "generation": {"n_samples": 4, "max_new_tokens": 4},
        "actor": {"model_path": str(micro_model_dir)},
        "data": {"source": "environment", "max_train_steps": 3},
        "saver": {"export_hf_at_end": False},
        "stats": {"progress_bar": False, "plot": False},
        "weight_sync": {"bucket_size_mb": 0.05},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    res = subprocess.run([sys.executable, "-m", "arealite.train", "--config", str(tmp_path / "cfg.yaml")],
                         cwd=tmp_path, env=run_env(TESTS), capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / "oe" / "t" / "stats.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["rollout/n_trajectories"] == 16
        assert r["rollout/reward_mean"] > 0  # every step earns the environment's partial credit
    assert any("eval/accuracy" in r for r in records)
