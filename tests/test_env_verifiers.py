"""verifiers environments as a workflow (`rollout.workflow: verifiers`): a user's SingleTurnEnv
and ToolEnv built offline (tests/user_pkg/vf_envs.py), driven by verifiers itself through the
OpenAI-compatible endpoint; the rubric's reward on the trajectory; an environment that raises,
hangs or scores NaN costs its episode only; a missing environment says how to install it; and
a run through `python -m arealite.train`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from transformers import AutoTokenizer

from conftest import ScriptedChat as Scripted
from conftest import run_env

pytest.importorskip("verifiers")

from arealite.config.schema import ArealiteConfig, GenerationConfig, RolloutConfig  # noqa: E402
from arealite.environments.verifiers_env import EnvironmentNotFound, VerifiersWorkflow  # noqa: E402
from arealite.workflow.registry import build_workflow, environment_prompt_sets, workflow_problems  # noqa: E402

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))


@pytest.fixture(scope="module")
def tok(micro_model_dir):
    return AutoTokenizer.from_pretrained(micro_model_dir)


def _wf(tok, env="user_pkg.vf_envs:single_turn", n=2, on_error="zero", timeout_s=60.0, **env_args):
    return VerifiersWorkflow(env, env_args, tokenizer=tok, generation=GenerationConfig(n_samples=n, max_new_tokens=16),
                             rollout=RolloutConfig(on_reward_error=on_error), timeout_s=timeout_s)


def _item(wf, i=0):
    return {**wf.env.get_dataset()[i], "prompt_id": i}


async def test_single_turn_env_reward_is_the_rubrics(tok):
    wf = _wf(tok)
    item = _item(wf, 3)  # What is 3 + 3?
    td = await wf.arun_episode(Scripted(tok, ["it is 6", "no idea"]), item)
    assert td["group_id"].unique().numel() == 1 and td["input_ids"].shape[0] == 2
    for row in range(2):  # each reply (prompt masked) with the rubric's own score of it
        mask = td["loss_mask"][row]
        reply = tok.decode(td["input_ids"][row][mask], skip_special_tokens=True)
        assert not mask[0] and reply in ("it is 6", "no idea")
        assert td["rewards"][row].item() == pytest.approx(1.0 if reply == "it is 6" else 0.1 / 8)
    assert wf.stats()["env_errors"] == 0 and wf.stats()["agent_calls"] == 2


async def test_tool_env_turns_are_token_exact_and_the_tool_result_is_masked(tok):
    wf = _wf(tok, env="user_pkg.vf_envs:tool_env", n=1)
    call = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 3}}</tool_call>'
    model = Scripted(tok, [call, "it is 6"])
    td = await wf.arun_episode(model, _item(wf, 3))
    assert td["rewards"].tolist() == [1.0] and wf.stats()["agent_tool_calls"] == 1
    assert wf.stats()["agent_rerendered"] == 0  # the second call continued the first, nothing re-tokenized
    ids, mask = td["input_ids"][0].tolist(), td["loss_mask"][0].tolist()
    second_prompt = model.prompts[1]
    assert ids[: len(second_prompt)] == second_prompt  # one row: first prompt, reply, tool result, reply
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    assert "add" in trained and "it is 6" in trained and "6" not in tok.decode(model.prompts[0])
    tool_piece = tok.decode([t for t, m in zip(ids[len(model.prompts[0]):len(second_prompt)],
                                               mask[len(model.prompts[0]):len(second_prompt)]) if not m])
    assert "6" in tool_piece  # the tool's answer is context, not trained on


@pytest.mark.parametrize("fail, counter", [("raise", "env_errors"), ("hang", "env_timeouts"), ("nan", "env_bad_rewards")])
async def test_a_failing_environment_costs_its_episode_not_the_run(tok, fail, counter):
    odd = 1  # the environment fails on items whose answer is odd
    wf = _wf(tok, on_error="reject", timeout_s=1.0, fail=fail)
    items = [_item(wf, i) for i in range(6)]
    odd_items = [it for it in items if int(it["answer"]) % 2 == odd]
    even_items = [it for it in items if int(it["answer"]) % 2 != odd]
    assert await wf.arun_episode(Scripted(tok, ["x"]), odd_items[0]) is None  # rejected
    assert wf.stats()[counter] == 2 and wf.stats()["env_rejected_groups"] == 1
    assert await wf.arun_episode(Scripted(tok, ["x"]), even_items[0]) is not None  # and the next item goes on
    zero = _wf(tok, on_error="zero", timeout_s=1.0, fail=fail)
    td = await zero.arun_episode(Scripted(tok, ["x"]), odd_items[0])
    if fail == "raise":  # it failed before the model was called: nothing to train on
        assert td is None and zero.stats()["episodes_without_calls"] == 2
    else:  # the model's replies stay, with reward 0
        assert td["rewards"].tolist() == [0.0, 0.0]
    assert zero.stats()[counter] == 2 and zero.stats()["env_rejected_groups"] == 0


def test_missing_environments_say_which_field_and_how_to_install(tok):
    with pytest.raises(EnvironmentNotFound, match=r"rollout.workflow_kwargs.env='no-such-env' is not an installed "
                                                  r"verifiers environment.*prime env install no-such-env"):
        _wf(tok, env="no-such-env")
    with pytest.raises(EnvironmentNotFound, match="rollout.workflow_kwargs.env='user_pkg.vf_envs:nothing'"):
        _wf(tok, env="user_pkg.vf_envs:nothing")
    with pytest.raises(EnvironmentNotFound, match="not a verifiers Environment"):
        _wf(tok, env="user_pkg.vf_envs:add", a=1, b=2)


def _cfg(tmp_path: Path, model: Path, steps: int = 3, **kwargs) -> dict:
    return {
        "experiment": {"name": "vf", "trial": "t", "output_root": str(tmp_path / "runs")},
        "launch": {"n_servers": 1, "n_trainer_procs": 1},
        "rollout": {"consumer_batch_size": 4, "max_head_offpolicyness": 1, "workflow": "verifiers",
                    "workflow_kwargs": {"env": "user_pkg.vf_envs:single_turn", "env_args": {"n": 16}, "timeout_s": 120,
                                        **kwargs}},
        "generation": {"n_samples": 4, "max_new_tokens": 8},
        "actor": {"model_path": str(model)},
        "data": {"source": "environment", "max_train_steps": steps},
        "saver": {"export_hf_at_end": False},
        "stats": {"progress_bar": False, "plot": False},
        "weight_sync": {"bucket_size_mb": 0.05},
    }


def test_the_environments_datasets_feed_the_controller(micro_model_dir, tmp_path):
    cfg = ArealiteConfig.model_validate(_cfg(tmp_path, micro_model_dir))
    assert workflow_problems(cfg) == []
    train, held_out = environment_prompt_sets(cfg)
    assert len(train) == 16 and len(held_out) == 4
    assert [it["prompt_id"] for it in train] == list(range(16)) and train[5]["prompt"][0]["content"] == "What is 5 + 0?"
    bad = ArealiteConfig.model_validate({**_cfg(tmp_path, micro_model_dir), "rollout": {"workflow": "rlvr"}})
    assert [p.path for p in workflow_problems(bad)] == ["data.source"]


def test_built_from_config_by_name(micro_model_dir, tmp_path, tok):
    cfg = ArealiteConfig.model_validate(_cfg(tmp_path, micro_model_dir))
    wf = build_workflow(cfg, tok)
    assert isinstance(wf, VerifiersWorkflow) and wf.generation.n_samples == 4
    assert build_workflow(cfg, tok, evaluation=True).generation.greedy


@pytest.mark.slow
def test_a_verifiers_environment_trains_through_one_command(micro_model_dir, tmp_path):
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(_cfg(tmp_path, micro_model_dir)))
    res = subprocess.run([sys.executable, "-m", "arealite.train", "--config", str(tmp_path / "cfg.yaml")],
                         cwd=tmp_path, env=run_env(TESTS), capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / "vf" / "t" / "stats.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["rollout/n_trajectories"] == 16
        assert 0 < r["rollout/reward_mean"] <= 1  # the rubric's partial credit: every reply earns some
    assert any("eval/accuracy" in r for r in records)  # on the environment's eval dataset
