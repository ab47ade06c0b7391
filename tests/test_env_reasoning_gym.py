"""reasoning-gym tasks as a data source (`data.source: reasoning_gym`), their own `score_answer`
as the reward: answer extraction, a weighted composite, determinism, the errors, and a run
through `python -m arealite.train` that resumes with nothing trained twice or missing."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from conftest import run_env

from arealite.config.schema import REASONING_GYM_REWARD, ArealiteConfig
from arealite.data.dataset import DatasetError
from arealite.data.sources import load_prompt_sets
from arealite.environments.answers import extract_answer
from arealite.environments.reasoning_gym import reasoning_gym_reward
from arealite.utils.accounting import prompt_accounting
from arealite.workflow.common import item_fields

pytest.importorskip("reasoning_gym")

ARITH = {"name": "basic_arithmetic", "weight": 3,
         "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}}
SPELL = {"name": "spell_backward", "weight": 1, "config": {"min_word_len": 3, "max_word_len": 5}}


def _cfg(**rg) -> ArealiteConfig:
    return ArealiteConfig.model_validate({"data": {"source": "reasoning_gym", "reasoning_gym": rg}})


def _score(item: dict, completion: str) -> float:
    return reasoning_gym_reward(item["prompt"], completion, [], [], **item_fields(item))


@pytest.mark.parametrize("fmt, text, want", [
    ("answer_tags", "think <answer>1</answer> then <answer> 42 </answer>", "42"),
    ("answer_tags", "no tags at all", None),
    ("boxed", r"so \boxed{\frac{1}{2}} and finally \boxed{x^{2}}", "x^{2}"),
    ("boxed", r"\boxed{unclosed", None),
    ("last_line", "work\n\n  7 \n\n", "7"),
    ("whole", "  all of it \n", "all of it"),
    ("whole", "   ", None),
])
def test_answer_extraction(fmt, text, want):
    assert extract_answer(text, fmt) == want


def test_a_weighted_composite_is_deterministic_and_scored_by_each_task():
    cfg = _cfg(tasks=[ARITH, SPELL], size=200, eval_size=40, seed=7)
    assert cfg.data.reward_fn == REASONING_GYM_REWARD  # the task's score unless reward_fn is set
    train, held_out = load_prompt_sets(cfg)
    again, _ = load_prompt_sets(cfg)
    assert [r["prompt"] for r in train] == [r["prompt"] for r in again]  # same seed, same items (resume)
    counts = collections.Counter(r["reasoning_gym"]["task"] for r in train)
    assert set(counts) == {"basic_arithmetic", "spell_backward"}
    assert 0.6 < counts["basic_arithmetic"] / 200 < 0.9  # weight 3:1
    assert {r["prompt"] for r in held_out}.isdisjoint(r["prompt"] for r in train)
    assert 0 < len(held_out) <= 40
    for item in train[:20]:
        ans = item["reasoning_gym"]["entry"]["answer"]
        assert item["prompt"].endswith("between <answer> and </answer>.")
        assert _score(item, f"I think <answer>{ans}</answer>") == 1.0
        assert _score(item, "no answer here") == 0.0
        assert _score(item, f"<answer>{ans}9z</answer>") < 1.0


def test_answer_format_and_prompt_template_reach_the_reward():
    cfg = _cfg(task="basic_arithmetic", config=ARITH["config"], size=5, answer_format="last_line",
               prompt_template="Q: {question}\nA:")
    train, held_out = load_prompt_sets(cfg)
    assert held_out == [] and train[0]["prompt"].startswith("Q: ") and train[0]["prompt"].endswith("\nA:")
    ans = train[0]["answer"]
    assert _score(train[0], f"let me see\n{ans}") == 1.0
    assert _score(train[0], f"<answer>{ans}</answer>\nsomething else") == 0.0


def test_entries_are_plain_data_that_checkpoints_load_without_pickle(tmp_path):
    import torch

    train, _ = load_prompt_sets(_cfg(task="knights_knaves", size=3))  # its entries hold a str subclass
    torch.save(list(train), tmp_path / "items.pt")
    loaded = torch.load(tmp_path / "items.pt", weights_only=True)
    assert _score(loaded[0], f"<answer>{loaded[0]['answer']}</answer>") == 1.0


@pytest.mark.parametrize("data, field_words", [
    ({"source": "reasoning_gym"}, "reasoning_gym is not set"),
    ({"reasoning_gym": {"task": "gcd"}}, "set source: reasoning_gym"),
    ({"source": "reasoning_gym", "train_path": "x.jsonl", "reasoning_gym": {"task": "gcd"}}, "remove train_path"),
    ({"source": "reasoning_gym", "reasoning_gym": {"task": "gcd", "tasks": [{"name": "lcm"}]}}, "not both"),
    ({"source": "reasoning_gym", "reasoning_gym": {"tasks": [{"name": "gcd"}, {"name": "gcd"}]}}, "listed twice"),
    ({"source": "reasoning_gym", "reasoning_gym": {"task": "gcd", "prompt_template": "no slot"}}, "{question}"),
])
def test_config_errors_name_the_field(data, field_words):
    with pytest.raises(ValidationError, match="data") as e:
        ArealiteConfig.model_validate({"data": data})
    assert field_words in str(e.value)


def test_unknown_task_bad_settings_and_a_missing_library_say_how_to_fix(monkeypatch):
    with pytest.raises(DatasetError, match=r"'basic_arithmetics' is not a reasoning-gym task \(did you mean"):
        load_prompt_sets(_cfg(task="basic_arithmetics"))
    with pytest.raises(DatasetError, match="config .* is refused by reasoning-gym"):
        load_prompt_sets(_cfg(task="basic_arithmetic", config={"no_such_setting": 1}))
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed
    with pytest.raises(DatasetError, match=r"pip install 'arealite\[envs\]'"):
        load_prompt_sets(_cfg(task="gcd"))


def test_the_reward_refuses_items_from_elsewhere():
    with pytest.raises(ValueError, match="data.reward_fn"):
        reasoning_gym_reward("p", "c", [], [], answer="3")


# ------------------------------------------------------------ end to end


def _run(tmp_path: Path, model: Path, steps: int) -> subprocess.CompletedProcess:
    cfg = {
        "experiment": {"name": "rg", "trial": "t", "output_root": str(tmp_path / "runs")},
        "launch": {"n_servers": 1, "n_trainer_procs": 1},
        "rollout": {"consumer_batch_size": 4, "max_head_offpolicyness": 1, "dump_dir": str(tmp_path / "dump")},
        "generation": {"n_samples": 4, "max_new_tokens": 8},
        "actor": {"model_path": str(model)},
        "data": {"source": "reasoning_gym", "max_train_steps": steps,
                 "reasoning_gym": {"tasks": [ARITH, SPELL], "size": 16, "eval_size": 4, "answer_format": "whole"}},
        "saver": {"freq_steps": 2, "export_hf_at_end": False},
        "stats": {"progress_bar": False, "plot": False},
        "weight_sync": {"bucket_size_mb": 0.05},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "-m", "arealite.train", "--config", str(tmp_path / "cfg.yaml")],
                          cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=400)


@pytest.mark.slow
def test_two_tasks_train_through_one_command_then_resume(micro_model_dir, tmp_path):
    res = _run(tmp_path, micro_model_dir, steps=3)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    stats = tmp_path / "runs" / "rg" / "t" / "stats.jsonl"
    records = [json.loads(line) for line in stats.read_text().splitlines()]
    assert [r["step"] for r in records if "rollout/reward_mean" in r] == [1, 2, 3]
    assert any("eval/accuracy" in r for r in records)

    res2 = _run(tmp_path, micro_model_dir, steps=6)  # the same command, a larger budget: resumes at step 2
    assert res2.returncode == 0, res2.stdout[-3000:] + res2.stderr[-3000:]
    assert "resumed from" in res2.stdout + res2.stderr
    acc = prompt_accounting(stats, expected_ids=range(16))
    assert acc.finished and acc.steps == list(range(1, 7))
    assert sum(r.trained for r in acc.epochs.values()) == 6 * 4
    for ep, rep in acc.epochs.items():
        assert rep.duplicated == [], f"epoch {ep}: trained twice: {rep.duplicated}"
    assert acc.epochs[0].exact and acc.epochs[0].handed_out  # 16 prompts, 4 steps of 4: each once

    # Every reward is the task's own score of that completion.
    train, held_out = load_prompt_sets(ArealiteConfig.model_validate(yaml.safe_load((tmp_path / "cfg.yaml").read_text())))
    by_prompt = {r["prompt"]: r for r in [*train, *held_out]}  # the dump holds evaluation's answers too
    dumped = [json.loads(line) for f in sorted((tmp_path / "dump").glob("*.jsonl")) for line in f.read_text().splitlines()]
    assert len(dumped) >= 6 * 16
    for d in dumped:
        assert d["reward"] == pytest.approx(_score(by_prompt[d["prompt"]], d["completion"]))


def test_the_reasoning_gym_demo_config_generates_what_its_prepare_step_warms_up_on():
    """examples/reasoning_gym: the config is valid, and every generated prompt ends with the word
    to spell backward, which prepare.py cuts out for its copying warm-up answers."""
    from conftest import REPO

    from arealite.check import load_run_config
    from arealite.data.reasoning_gym import reasoning_gym_items

    cfg = load_run_config(REPO / "examples/reasoning_gym/config.yaml", check_paths=False)
    train, held_out = reasoning_gym_items(cfg.data.reasoning_gym, cfg.experiment.seed)
    assert len(train) == 4000 and 100 < len(held_out) <= 200  # held-out words seen in training are dropped
    for row in list(train)[:200]:
        word = row["reasoning_gym"]["entry"]["question"].rsplit(":", 1)[1].strip()
        assert row["prompt"].endswith(f": {word} =") and row["answer"] == word[::-1]
