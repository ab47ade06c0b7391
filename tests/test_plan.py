"""The planner's command and its refusal: `python -m arealite.plan`, and the config check that
refuses a layout predicted not to fit on the GPUs ``launch.gpus`` names, naming the fields and
the cheapest change that fits."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from arealite.check import load_run_config
from arealite.config.loader import ConfigError, load_config
from arealite.plan.__main__ import main as plan_main
from arealite.plan.gpus import parse_gpus
from arealite.plan.run_plan import fit_problems, plan_problems, plan_run

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(REPO.glob("examples/*/config.yaml")) + [REPO / "examples/configs/default.yaml"]


@pytest.fixture(scope="module")
def config_only(tmp_path_factory, tiny_model_dir) -> Path:
    """A model directory with its config.json alone (no weights, no tokenizer)."""
    out = tmp_path_factory.mktemp("config_only")
    shutil.copy(tiny_model_dir / "config.json", out / "config.json")
    return out


def _cfg(model: Path, *overrides: str):
    return load_config(None, [f"actor.model_path={model}", "data.max_prompt_len=64",
                              "generation.max_new_tokens=64", *overrides], check_paths=False)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.parent.name)
def test_the_plan_of_every_example_config_runs(example, config_only, capsys):
    """Every example config plans on a named cluster (its model swapped for a config-only one)."""
    status = plan_main([str(example), f"actor.model_path={config_only}", "critic.model_path=null",
                        "server.model_path=null", "--gpus", "8xH100"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "trainer rank" in out and "server" in out and "fits" in out


def test_a_layout_over_the_card_is_refused_naming_the_field_and_a_fix_that_fits(config_only):
    """On a card too small for the micro-batch's activations the problem names the engine's field
    and the cheapest change the same prediction says fits."""
    cfg = _cfg(config_only, "actor.mb_max_tokens=65536", "launch.n_trainer_procs=1")
    full = plan_run(cfg, parse_gpus("1xH100"))
    need = full.trainers["actor"].total
    small = parse_gpus("1xH100", memory_gib=0.8 * need / (1 << 30))
    (problem,) = [p for p in plan_problems(plan_run(cfg, small)) if p.path.startswith("actor.")]
    assert problem.path == "actor.mb_max_tokens" and "cheapest fix that fits: actor.mb_max_tokens=" in problem.message
    fixed_value = int(problem.message.split("actor.mb_max_tokens=")[1].split()[0])
    fixed = _cfg(config_only, f"actor.mb_max_tokens={fixed_value}", "launch.n_trainer_procs=1")
    assert plan_run(fixed, small).trainers["actor"].total <= small.memory_bytes


def test_the_config_check_refuses_warns_or_stays_quiet(config_only, caplog):
    """`launch.memory_check`: error refuses before anything starts, warn logs, off says nothing;
    without `launch.gpus` no memory is checked."""
    args = [f"actor.model_path={config_only}", "data.max_prompt_len=64", "generation.max_new_tokens=64",
            "actor.mb_max_tokens=65536", "launch.gpus=1xH100", "launch.gpu_memory_gib=0.05"]
    with pytest.raises(ConfigError, match=r"actor.mb_max_tokens = 65536: a trainer rank is predicted to need"):
        load_run_config(None, args, check_paths=False)
    with caplog.at_level("WARNING"):
        load_run_config(None, args + ["launch.memory_check=warn"], check_paths=False)
    assert "memory check" in caplog.text
    assert fit_problems(load_config(None, args + ["launch.memory_check=off"], check_paths=False)) == []
    assert fit_problems(load_config(None, args[:-2], check_paths=False)) == []


def test_an_unknown_gpu_is_named_with_the_known_ones(config_only, capsys):
    assert plan_main([f"actor.model_path={config_only}", "--gpus", "8xH900"]) == 2
    err = capsys.readouterr().err
    assert "H900" in err and "h100" in err
    with pytest.raises(ConfigError, match=r"launch.gpus"):
        load_run_config(None, [f"actor.model_path={config_only}", "launch.gpus=8xH900"], check_paths=False)


def test_the_command_says_what_will_not_fit_and_draws_it(config_only, tmp_path, capsys):
    png = tmp_path / "plan.png"
    status = plan_main([f"actor.model_path={config_only}", "actor.mb_max_tokens=65536", "--gpus", "H100",
                        "--gpu-memory-gib", "0.05", "--png", str(png)])
    captured = capsys.readouterr()
    assert status == 1
    assert "will not fit: actor.mb_max_tokens" in captured.err and "parameters" in captured.out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_a_critic_is_planned_beside_the_actor(config_only):
    cfg = _cfg(config_only, "critic.enabled=true", f"critic.model_path={config_only}", "algorithm.adv_estimator=gae")
    plan = plan_run(cfg, parse_gpus("8xH100"))
    assert set(plan.trainers) == {"actor", "critic"}
    assert plan.table().count("trainer rank") == 2


@pytest.mark.parametrize("example", sorted(REPO.glob("examples/planning/*.yaml")), ids=lambda p: p.stem)
def test_the_worked_examples_of_docs_planning_fit_as_the_docs_say(example, capsys, monkeypatch):
    """docs/planning.md's runs (published models' config.json, no weights) plan and fit; the 7B one
    without checkpointing is refused with checkpointing named."""
    monkeypatch.chdir(REPO)
    assert plan_main([str(example.relative_to(REPO))]) == 0
    assert "fits: every process" in capsys.readouterr().out
    if "qwen2.5-7b" in example.name:
        assert plan_main([str(example.relative_to(REPO)), "actor.gradient_checkpointing=false"]) == 1
        assert "cheapest fix that fits: actor.gradient_checkpointing=true" in capsys.readouterr().err
