"""The library trainer's parts that need no servers: workflows named in config, the
launcher's entry point, stats assembly and hooks."""

from __future__ import annotations

import pytest

from arealite.check import load_run_config
from arealite.config.loader import ConfigError
from arealite.launcher.local import DEFAULT_ENTRY, parse_launcher_args
from arealite.trainer import CallbackHook, StepStats, TrainerHook
from arealite.workflow.registry import build_workflow, builtin_workflows, resolve_workflow_class


def _cfg(*overrides: str):
    return load_run_config(None, list(overrides), check_paths=False)


def test_builtin_workflows_are_found_where_they_are_defined():
    names = builtin_workflows()
    assert {"rlvr", "multi_turn"} <= set(names)
    from arealite.workflow.rlvr import RLVRWorkflow

    assert names["rlvr"] is RLVRWorkflow
    assert resolve_workflow_class("rlvr") is RLVRWorkflow


def test_workflows_of_the_rooms_above_are_builtins_by_import_string():
    from arealite.agent.workflow import AgentWorkflow
    from arealite.environments.openenv_env import OpenEnvWorkflow
    from arealite.environments.verifiers_env import VerifiersWorkflow

    names = builtin_workflows()
    assert (names["agent"], names["verifiers"], names["openenv"]) == (AgentWorkflow, VerifiersWorkflow, OpenEnvWorkflow)
    assert resolve_workflow_class("agent") is AgentWorkflow


@pytest.mark.parametrize("value,message", [
    ("nope", "neither a built-in workflow"),
    ("user_pkg.missing:X", "cannot import module 'user_pkg.missing'"),
    ("user_pkg.workflows:Missing", "has no attribute 'Missing'"),
    ("user_pkg.workflows:NotAWorkflow", "arun_episode"),
    ("arealite.workflow.agent:AgentWorkflow", "'agent' (arealite.agent.workflow:AgentWorkflow)"),
])
def test_a_bad_workflow_name_fails_naming_the_field(value, message):
    with pytest.raises(ConfigError) as e:
        _cfg(f"rollout.workflow={value}")
    text = str(e.value)
    assert "rollout.workflow" in text and message in text and value in text


def test_workflow_kwargs_are_checked_against_the_constructor():
    with pytest.raises(ConfigError) as e:
        _cfg("rollout.workflow=user_pkg.workflows:NeedsPieces", "rollout.workflow_kwargs={bonsu: 1}")
    text = str(e.value)
    assert "rollout.workflow_kwargs.bonsu" in text and "it takes: bonus, tag" in text
    assert "rollout.workflow_kwargs.bonus" in text and "required" in text  # misspelt, so missing
    with pytest.raises(ConfigError, match="filled by arealite itself"):
        _cfg("rollout.workflow=user_pkg.workflows:NeedsPieces", "rollout.workflow_kwargs={bonus: 1, tokenizer: 2}")


def test_workflow_gets_the_pieces_it_names_and_a_greedy_copy_for_evaluation():
    cfg = _cfg("rollout.workflow=user_pkg.workflows:NeedsPieces", "rollout.workflow_kwargs={bonus: 0.5}",
               "generation.n_samples=8", "generation.temperature=0.7", "evaluation.max_new_tokens=9",
               "data.eval_path=held_out.jsonl")
    tok = object()
    wf = build_workflow(cfg, tok)
    assert wf.tokenizer is tok and wf.bonus == 0.5 and wf.tag == "x"
    assert wf.generation.n_samples == 8 and not wf.generation.greedy
    ev = build_workflow(cfg, tok, evaluation=True)
    assert ev.generation.n_samples == 1 and ev.generation.greedy and ev.generation.max_new_tokens == 9
    assert cfg.generation.n_samples == 8  # the run's config is untouched


def test_a_workflow_with_from_config_is_built_by_it():
    cfg = _cfg("rollout.workflow=user_pkg.workflows:FromConfig", "rollout.workflow_kwargs={scale: 3}")
    wf = build_workflow(cfg, "tok")
    assert (wf.scale, wf.tokenizer, wf.cfg.rollout.workflow) == (3, "tok", "user_pkg.workflows:FromConfig")
    with pytest.raises(ConfigError, match="rollout.workflow_kwargs.size"):
        _cfg("rollout.workflow=user_pkg.workflows:FromConfig", "rollout.workflow_kwargs={size: 3}")


def test_launcher_runs_the_library_trainer_unless_given_a_script(tmp_path):
    a = parse_launcher_args(["--config", "c.yaml", "actor.optimizer.lr=1e-5"])
    assert (a.script, a.overrides) == (DEFAULT_ENTRY, ["actor.optimizer.lr=1e-5"])
    a = parse_launcher_args(["examples/rlvr/train.py", "--config", "c.yaml", "x.y=1"])
    assert (a.script, a.overrides) == ("examples/rlvr/train.py", ["x.y=1"])
    a = parse_launcher_args(["arealite.train", "x.y=1"])
    assert a.script == "arealite.train"
    for bad in (["nowhere.py"], ["no_such_pkg.mod"], ["a/b"]):
        with pytest.raises(SystemExit) as e:
            parse_launcher_args(bad)
        assert e.value.code == 4


def test_step_stats_assembles_one_record():
    s = StepStats(version=3)
    s.lap("rollout_wait")
    s.add_train([{"loss": 1.0, "grad_norm": 2.0}, {"loss": 3.0, "grad_norm": 4.0}])
    s.lap("train")
    s.add("weight_sync", {"total_s": 0.5, "server": "ignored-not-a-number", "ok": True})
    s.add_rollout_side({"running": 2, "paused": False}, {"retries": 1, "n_healthy": 2, "servers": {}})
    s.values["rollout/n_tokens"] = 100.0
    rec = s.finish()
    assert rec["train/loss"] == 2.0 and rec["train/grad_norm"] == 3.0
    assert rec["weight_sync/total_s"] == 0.5 and "weight_sync/server" not in rec and "weight_sync/ok" not in rec
    assert rec["controller/running"] == 2.0 and rec["client/retries"] == 1.0 and rec["client/n_healthy"] == 2.0
    assert rec["time/step_s"] >= rec["time/train_s"] >= 0
    assert rec["perf/train_tokens_per_s"] == pytest.approx(100.0 / max(rec["time/train_s"], 1e-9))


def test_callback_hook_takes_only_known_events():
    seen = []
    hook = CallbackHook(on_step_end=lambda trainer, step, stats: seen.append(step))
    hook.on_step_end(None, 4, {})
    hook.on_train_start(None, 0)  # not given: the no-op of TrainerHook
    assert seen == [4] and isinstance(hook, TrainerHook)
    with pytest.raises(TypeError, match="on_step_ends"):
        CallbackHook(on_step_ends=print)
