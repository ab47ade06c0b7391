"""The config mechanism: YAML + dotted overrides, error messages, cross-field rules, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from arealite.config import (
    ArealiteConfig,
    ConfigError,
    check_config,
    check_launch,
    dump_config,
    load_config,
    parse_args,
    parse_override_value,
)
from arealite.config.docs import REGENERATE, render_reference
from arealite.config.loader import _model_at, _section_model

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "configs" / "default.yaml"


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def leaf_paths(model=ArealiteConfig, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the schema."""
    out = []
    for name, field in model.model_fields.items():
        sub = _section_model(field.annotation)
        if sub is not None:
            out += leaf_paths(sub, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


def optional_section(dotted: str, part: str) -> bool:
    """Whether the field holding `part` in `dotted` is an optional section (`X | None`)."""
    model = ArealiteConfig
    parents = dotted.split(".")
    for name in parents[:parents.index(part) - 1]:
        model = _section_model(model.model_fields[name].annotation)
    field = model.model_fields[parents[parents.index(part) - 1]]
    return field.default is None and _section_model(field.annotation) is not None


def errors_of(path, overrides=(), check_paths=False) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, check_paths=check_paths)
    return info.value


# --------------------------------------------------------------------------- malformed configs

# (id, YAML text, overrides, dotted path the message must name, value it must show)
MALFORMED = [
    ("batch-zero", "rollout: {consumer_batch_size: 0}", [], "rollout.consumer_batch_size", "= 0"),
    ("staleness-negative", "rollout: {max_head_offpolicyness: -1}", [], "rollout.max_head_offpolicyness", "= -1"),
    ("max-new-tokens-zero", "generation: {max_new_tokens: 0}", [], "generation.max_new_tokens", "= 0"),
    ("c-clip-not-above-1", "algorithm: {c_clip: 1.0}", [], "algorithm.c_clip", "= 1.0"),
    ("eps-clip-zero", "algorithm: {eps_clip: 0}", [], "algorithm.eps_clip", "= 0"),
    ("eps-clip-high-negative", "algorithm: {eps_clip_high: -0.1}", [], "algorithm.eps_clip_high", "= -0.1"),
    ("lr-negative", "actor: {optimizer: {lr: -1.0e-5}}", [], "actor.optimizer.lr", "-1e-05"),
    ("lr-not-a-number", "actor: {optimizer: {lr: fast}}", [], "actor.optimizer.lr", "'fast'"),
    ("dtype-literal", "actor: {dtype: float64}", [], "actor.dtype", "'float64'"),
    ("backend-literal", "launch: {server_backend: vllm}", [], "launch.server_backend", "'vllm'"),
    ("list-item-type", "generation: {stop_token_ids: [1, x]}", [], "generation.stop_token_ids[1]", "'x'"),
    ("list-given-scalar", "generation: {stop_token_ids: 5}", [], "generation.stop_token_ids", "= 5"),
    ("top-p-above-1", "generation: {top_p: 1.5}", [], "generation.top_p", "= 1.5"),
    ("temperature-negative", "generation: {temperature: -1}", [], "generation.temperature", "= -1"),
    ("section-scalar", "launch: 3", [], "launch", "= 3"),
    ("section-list", "actor: [1, 2]", [], "actor", "[1, 2]"),
    ("unknown-section", "actors: {model_path: x}", [], "actors", "model_path"),
    ("unknown-nested-key", "actor: {optimizer: {learning_rate: 0.1}}", [], "actor.optimizer.learning_rate", "0.1"),
    ("bool-word", "data: {shuffle: maybe}", [], "data.shuffle", "'maybe'"),
    ("name-with-space", "experiment: {name: my run}", [], "experiment.name", "'my run'"),
    ("name-with-slash", "experiment: {trial: a/b}", [], "experiment.trial", "'a/b'"),
    ("seed-fraction", "experiment: {seed: 1.5}", [], "experiment.seed", "= 1.5"),
    ("port-range", "server: {base_port: 70000}", [], "server.base_port", "= 70000"),
    ("server-addr-format", "launch: {server_addrs: [localhost]}", [], "launch.server_addrs", "localhost"),
    ("server-addr-port", "launch: {server_addrs: ['h:99999']}", [], "launch.server_addrs", "h:99999"),
    ("env-name", "launch: {trainer_env: {1BAD: x}}", [], "launch.trainer_env", "1BAD"),
    ("trainer-procs-zero", "launch: {n_trainer_procs: 0}", [], "launch.n_trainer_procs", "= 0"),
    ("keep-last-zero", "saver: {keep_last: 0}", [], "saver.keep_last", "= 0"),
    ("recover-mode", "recover: {mode: sometimes}", [], "recover.mode", "'sometimes'"),
    ("yes-is-not-a-mode", "stats: {wandb: {mode: yes}}", [], "stats.wandb.mode", "'yes'"),
    ("bucket-zero", "weight_sync: {bucket_size_mb: 0}", [], "weight_sync.bucket_size_mb", "= 0"),
    ("workflow-error-literal", "rollout: {on_workflow_error: ignore}", [], "rollout.on_workflow_error", "'ignore'"),
    ("int-from-word", "data: {total_train_epochs: eight}", [], "data.total_train_epochs", "'eight'"),
    ("mem-fraction", "server: {sglang: {mem_fraction_static: 1.5}}", [], "server.sglang.mem_fraction_static", "= 1.5"),
    ("null-for-int", "actor: {mb_max_tokens: null}", [], "actor.mb_max_tokens", "= null"),
    ("top-level-list", "- a\n- b\n", [], "<config>", "[a, b]"),
    ("top-level-scalar", "just a string\n", [], "<config>", "'just a string'"),
    ("number-as-key", "1: 2\n", [], "1", "unknown key '1'"),
    ("python-tag", "actor: {dtype: !!python/object:os.system x}", [], "<file>", "python/object"),
    # cross-field rules
    ("batch-not-divisible", "rollout: {consumer_batch_size: 6}\nlaunch: {n_trainer_procs: 4}", [],
     "rollout.consumer_batch_size", "= 6"),
    ("rloo-group-of-one", "algorithm: {adv_estimator: rloo}\ngeneration: {n_samples: 1}", [],
     "generation.n_samples", "= 1"),
    ("eval-without-data", "evaluation: {freq_steps: 5}", [], "evaluation.freq_steps", "= 5"),
    ("warmup-past-total", "actor: {optimizer: {warmup_steps: 10, total_steps: 5}}", [],
     "actor.optimizer.warmup_steps", "= 10"),
    ("context-too-short", "server: {context_length: 64}\ngeneration: {max_new_tokens: 100}", [],
     "generation.max_new_tokens", "= 100"),
    ("prompt-plus-new-tokens", "server: {context_length: 128}\ndata: {max_prompt_len: 100}\n"
     "generation: {max_new_tokens: 64}", [], "generation.max_new_tokens", "data.max_prompt_len (100)"),
    # the same kinds of mistakes made on the command line
    ("override-bad-value", "", ["rollout.consumer_batch_size=-3"], "rollout.consumer_batch_size", "= -3"),
    ("override-unknown-key", "", ["actor.optimzer.lr=1e-5"], "actor.optimzer", "did you mean 'optimizer'"),
    ("override-into-leaf", "", ["rollout.queue_size.max=3"], "rollout.queue_size.max", "not a section"),
    ("override-bad-yaml", "", ["generation.stop_token_ids=[1,"], "generation.stop_token_ids", "'[1,'"),
    ("override-empty-part", "", ["actor..dtype=float32"], "actor..dtype", "empty name"),
]


@pytest.mark.parametrize(
    "text,overrides,path,value", [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED]
)
def test_malformed_config_names_field_and_value(tmp_path, text, overrides, path, value):
    err = errors_of(write(tmp_path, text), overrides)
    lines = [p.format() for p in err.problems]
    hits = [line for line in lines if line.startswith(path + " ") or line.startswith(path + ":")]
    assert hits, f"no problem names {path!r}:\n{err}"
    assert any(value in line for line in hits), f"{value!r} missing from {hits}"
    # ... and says what is allowed, not only that something is wrong.
    rules = ("must", "allowed", "is not", "e.g.", "set the value", "invalid YAML", "cannot parse", "empty name")
    assert any(r in line for line in hits for r in rules), f"no rule stated in {hits}"
    # The exception message is the same lines, one per problem, under a header.
    assert str(err).splitlines()[1:] == [f"  {line}" for line in lines]


@pytest.mark.parametrize(
    "text,path,message",
    [
        ("actor: {model_path: ''}", "actor.model_path", "python -m arealite.models.tiny"),
        ("actor: {model_path: {tmp}/nope}", "actor.model_path", "is not an existing directory"),
        ("actor: {model_path: {tmp}/empty}", "actor.model_path", "has no config.json"),
        ("actor: {model_path: {tmp}/model}\nserver: {model_path: {tmp}/gone}", "server.model_path", "{tmp}/gone"),
        ("actor: {model_path: {tmp}/model}\ndata: {train_path: {tmp}/train.jsonl}", "data.train_path",
         "does not exist"),
        ("actor: {model_path: {tmp}/model}\ndata: {eval_path: {tmp}/model}", "data.eval_path",
         "not one saved by `datasets.Dataset.save_to_disk`"),
    ],
    ids=["empty-model", "missing-model", "no-config-json", "server-model", "train-data", "eval-is-a-dir"],
)
def test_path_checks(tmp_path, text, path, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    cfg_file = write(tmp_path, text.replace("{tmp}", str(tmp_path)))
    err = errors_of(cfg_file, check_paths=True)
    assert [p.path for p in err.problems] == [path], str(err)
    assert message.replace("{tmp}", str(tmp_path)) in str(err)
    # Without path checks the same config loads: `show` works before the model exists.
    load_config(cfg_file, check_paths=False)


def test_model_dir_with_config_json_passes_path_checks(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "t.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    cfg = load_config(None, [f"actor.model_path={tmp_path}/m", f"data.train_path={tmp_path}/t.jsonl"])
    assert cfg.actor.model_path == f"{tmp_path}/m"


# --------------------------------------------------------------------------- overrides


def test_overrides_of_every_kind(tmp_path):
    path = write(tmp_path, """\
        actor:
          optimizer: {lr: 1.0e-3, warmup_steps: 4}
        server: {api_key: secret}
        """)
    cfg = load_config(
        path,
        [
            "actor.optimizer.lr=1e-5",            # nested float in YAML 1.2 exponent form
            "generation.stop_token_ids=[1, 2]",   # flow list
            "server.api_key=null",                # null
            "data.shuffle=false",                 # bool
            "rollout.consumer_batch_size=16",     # int
            "experiment.name=run-7",              # string
            "experiment.trial=no",                # a YAML 1.1 boolean, a string here
            "launch.trainer_env.NCCL_DEBUG=WARN",  # one entry of a mapping field
            "stats.wandb={mode: offline, project: p}",  # a flow mapping merges into the section
            "algorithm.c_clip=3",                 # int for a float field
            "evaluation.max_new_tokens=",         # nothing is null
        ],
        check_paths=False,
    )
    assert cfg.actor.optimizer.lr == 1e-5 and isinstance(cfg.actor.optimizer.lr, float)
    assert cfg.actor.optimizer.warmup_steps == 4  # untouched sibling keeps the file's value
    assert cfg.generation.stop_token_ids == [1, 2]
    assert cfg.server.api_key is None
    assert cfg.data.shuffle is False
    assert cfg.rollout.consumer_batch_size == 16
    assert cfg.experiment.name == "run-7"
    assert cfg.experiment.trial == "no"
    assert cfg.launch.trainer_env == {"NCCL_DEBUG": "WARN"}
    assert (cfg.stats.wandb.mode, cfg.stats.wandb.project, cfg.stats.wandb.entity) == ("offline", "p", None)
    assert cfg.algorithm.c_clip == 3.0
    assert cfg.evaluation.max_new_tokens is None


def test_later_override_wins_and_errors_point_to_it(tmp_path):
    path = write(tmp_path, "rollout:\n  consumer_batch_size: 4\n")
    cfg = load_config(path, ["rollout.consumer_batch_size=2", "rollout.consumer_batch_size=6"], check_paths=False)
    assert cfg.rollout.consumer_batch_size == 6
    err = errors_of(path, ["rollout.consumer_batch_size=0"])
    assert "override 'rollout.consumer_batch_size=0'" in str(err)
    err = errors_of(write(tmp_path, "rollout:\n  consumer_batch_size: 0\n", "f.yaml"))
    assert f"{tmp_path / 'f.yaml'}:2" in str(err)  # file and line of the bad key


@pytest.mark.parametrize(
    "text,expected",
    [
        ("1e-5", 1e-5), ("-2.5E3", -2500.0), (".5", 0.5), ("8", 8), ("-3", -3), ("010", 10),
        ("0x1F", 31), ("true", True), ("False", False), ("null", None), ("~", None), ("", None),
        ("no", "no"), ("on", "on"), ("yes", "yes"), ("1:30", "1:30"), ("2024-01-01", "2024-01-01"),
        ("'8'", "8"), ("[1, 2]", [1, 2]), ("{a: 1}", {"a": 1}), ("a b", "a b"), ("=", "="),
    ],
)
def test_override_values_follow_yaml_12(text, expected):
    assert parse_override_value(text) == expected
    assert type(parse_override_value(text)) is type(expected)


def test_unknown_key_lists_allowed_keys_and_suggests(tmp_path):
    err = errors_of(None, ["actor.optimzer.lr=1e-5", "rollout.max_head_offpolicynes=1", "zzz.a=1"])
    text = str(err)
    assert "actor.optimzer: unknown key 'optimzer'; did you mean 'optimizer'?" in text
    assert "[override 'actor.optimzer.lr=1e-5']" in text
    assert "mb_max_tokens" in text  # the allowed keys of `actor` are listed
    assert "did you mean 'max_head_offpolicyness'" in text
    assert "allowed sections: experiment, launch" in text
    # The same for keys in a file.
    err = errors_of(write(tmp_path, "generation:\n  temprature: 0.7\n"))
    assert "generation.temprature = 0.7: unknown key 'temprature'; did you mean 'temperature'?" in str(err)


def test_malformed_override_syntax():
    err = errors_of(None, ["noequals", "=5", "rollout.consumer_batch_size=3", "launch.n_trainer_procs=2"])
    # The cross-field rule is still checked next to the bad overrides.
    assert [p.path for p in err.problems] == ["<override>", "<override>", "rollout.consumer_batch_size"]
    err.problems.pop()
    assert all("dotted.key=value" in p.message for p in err.problems)
    with pytest.raises(TypeError):
        load_config(None, "actor.dtype=float32")  # one string, not a list


def test_override_into_a_scalar_section_of_the_file(tmp_path):
    err = errors_of(write(tmp_path, "launch: 3\n"), ["launch.n_servers=2"])
    assert any(p.path == "launch.n_servers" and "launch is 3" in p.message for p in err.problems)
    assert any(p.path == "launch" for p in err.problems)


def test_every_key_overridable_with_its_dumped_default():
    """Each leaf, set from the command line to its default as `show` writes it, gives the defaults."""
    defaults = ArealiteConfig()
    dumped = yaml.safe_load(dump_config(defaults))
    overrides = []
    for dotted in leaf_paths():
        node = dumped
        for part in dotted.split("."):
            if node is None:  # under an optional section left null (`actor.lora`): no default to dump
                break
            node = node[part]
        else:
            part = None
        if part is not None:
            continue
        text = yaml.safe_dump(node, default_flow_style=True, width=10**6).removesuffix("\n...\n").strip()
        overrides.append(f"{dotted}={text}")
    assert len(overrides) > 80
    assert load_config(None, overrides, check_paths=False) == defaults


# --------------------------------------------------------------------------- several errors, YAML


def test_several_errors_reported_together(tmp_path):
    path = write(tmp_path, """\
        rollout:
          consumer_batch_size: 0
          max_head_offpolicyness: -2
        generation:
          max_new_tokens: 0
        actor:
          dtype: float64
          optimzer: {}
        """)
    err = errors_of(path, ["algorithm.eps_clip=0", "nope=1"])
    paths = sorted(p.path for p in err.problems)
    assert paths == sorted([
        "rollout.consumer_batch_size", "rollout.max_head_offpolicyness", "generation.max_new_tokens",
        "actor.dtype", "actor.optimzer", "algorithm.eps_clip", "nope",
    ])
    lines = str(err).splitlines()
    assert lines[0] == f"7 config problems in {path}:"
    assert len(lines) == 8


def test_cross_field_errors_reported_together():
    err = errors_of(None, [
        "rollout.consumer_batch_size=5", "launch.n_trainer_procs=2", "algorithm.adv_estimator=rloo",
        "generation.n_samples=1", "evaluation.max_prompts=3", "actor.optimizer.warmup_steps=9",
        "actor.optimizer.total_steps=3",
    ])
    assert sorted(p.path for p in err.problems) == sorted([
        "rollout.consumer_batch_size", "generation.n_samples", "evaluation.max_prompts",
        "actor.optimizer.warmup_steps",
    ])
    assert "e.g. 4 or 6" in str(err)  # the nearest valid batch sizes


def test_field_and_cross_field_errors_in_one_round():
    # One invalid field does not hide a rule broken by two valid ones...
    err = errors_of(None, [
        "algorithm.eps_clip=0", "rollout.consumer_batch_size=3", "launch.n_trainer_procs=2",
    ])
    assert sorted(p.path for p in err.problems) == ["algorithm.eps_clip", "rollout.consumer_batch_size"]
    # ... and a rule that involves the invalid field waits until that field is fixed.
    err = errors_of(None, ["rollout.consumer_batch_size=3", "launch.n_trainer_procs=zero"])
    assert [p.path for p in err.problems] == ["launch.n_trainer_procs"]


def test_every_field_is_documented_and_every_section_forbids_unknown_keys():
    seen = set()

    def walk(model, prefix):
        assert model.model_config.get("extra") == "forbid", f"{prefix or 'the root'} accepts unknown keys"
        for name, field in model.model_fields.items():
            path = f"{prefix}.{name}" if prefix else name
            seen.add(path)
            assert (field.description or "").strip(), f"{path} has no docstring"
            section = _model_at(path.split("."))
            if section is not None:
                walk(section, path)

    walk(ArealiteConfig, "")
    assert len(seen) > 100  # the walk reached the leaves


def test_grpo_with_one_sample_is_allowed():
    cfg = load_config(None, ["generation.n_samples=1"], check_paths=False)
    assert cfg.algorithm.adv_estimator == "grpo"


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "experiment:\n  name: demo\nrollout:\n  consumer_batch_size: [8\n  queue_size: 4\n")
    err = errors_of(path)
    assert len(err.problems) == 1
    assert f"{path}:5:" in str(err)          # where the parser gave up
    assert "line 4" in str(err)              # where the unclosed list began
    assert "invalid YAML" in str(err)


def test_duplicate_key_is_an_error(tmp_path):
    path = write(tmp_path, "actor:\n  dtype: float32\n  dtype: bfloat16\n")
    err = errors_of(path)
    assert "duplicate key 'dtype' (first given on line 2)" in str(err)
    assert f"{path}:3:" in str(err)


def test_anchors_and_merge_keys(tmp_path):
    path = write(tmp_path, """\
        generation: &gen {n_samples: 2, max_new_tokens: 32}
        evaluation: {max_new_tokens: 8}
        data: {eval_path: e.jsonl}
        rollout: {<<: {consumer_batch_size: 4, queue_size: 64}, queue_size: 128}
        """)
    cfg = load_config(path, check_paths=False)
    assert (cfg.generation.n_samples, cfg.generation.max_new_tokens) == (2, 32)
    assert (cfg.rollout.consumer_batch_size, cfg.rollout.queue_size) == (4, 128)


def test_path_problems_reported_with_field_errors(tmp_path):
    err = errors_of(None, ["rollout.queue_size=0", "actor.model_path=/no/such/model"], check_paths=True)
    assert sorted(p.path for p in err.problems) == ["actor.model_path", "rollout.queue_size"]


def test_empty_file_empty_section_and_missing_file(tmp_path):
    assert load_config(write(tmp_path, "# only a comment\n"), check_paths=False) == ArealiteConfig()
    assert load_config(write(tmp_path, "actor:\nrollout:\n", "e.yaml"), check_paths=False) == ArealiteConfig()
    err = errors_of(tmp_path / "missing.yaml")
    assert "missing.yaml" in str(err) and "does not exist" in str(err)
    err = errors_of(tmp_path)
    assert "is a directory" in str(err)


def test_api_key_never_shown(tmp_path):
    err = errors_of(None, ["server.api_key=[hunter2]"])
    assert "hunter2" not in str(err) and "server.api_key = ***" in str(err)
    cfg = load_config(None, ["server.api_key=hunter2"], check_paths=False)
    assert cfg.server.api_key == "hunter2"
    assert "hunter2" not in dump_config(cfg)
    assert "hunter2" in dump_config(cfg, mask_secrets=False)


@pytest.mark.parametrize("value", ["no", "true", "1e5", "010", "null", "1:30", "0x10", "2024-01-01", "8"])
def test_dump_round_trips_strings_that_look_like_other_types(tmp_path, value):
    cfg = ArealiteConfig()
    cfg.actor.model_path = value
    cfg.data.prompt_key = value
    if ":" not in value:  # a directory name, no colon
        cfg.experiment.trial = value
    path = tmp_path / "dumped.yaml"
    path.write_text(dump_config(cfg))
    again = load_config(path, check_paths=False)
    assert again == cfg and again.actor.model_path == value


def test_check_config_on_programmatic_config():
    cfg = ArealiteConfig()
    cfg.rollout.consumer_batch_size = 3
    cfg.launch.n_trainer_procs = 2
    with pytest.raises(ConfigError, match="rollout.consumer_batch_size = 3"):
        check_config(cfg, check_paths=False)
    cfg.rollout.consumer_batch_size = 4
    assert check_config(cfg, check_paths=False) is cfg


def test_check_launch():
    external = ArealiteConfig.model_validate({"launch": {"n_servers": 0}})
    with pytest.raises(ConfigError, match="launch.server_addrs = \\[\\]: is empty"):
        check_launch(external, environ={})
    assert check_launch(external, environ={"AREALITE_SERVER_ADDRS": "h1:1000, h2:2000"}) == ["h1:1000", "h2:2000"]
    with pytest.raises(ConfigError, match="AREALITE_SERVER_ADDRS = 'h1'"):
        check_launch(external, environ={"AREALITE_SERVER_ADDRS": "h1"})
    both = ArealiteConfig.model_validate({"launch": {"n_servers": 2, "server_addrs": ["h:1"]}})
    with pytest.raises(ConfigError, match="set launch.n_servers=0"):
        check_launch(both, environ={})
    listed = ArealiteConfig.model_validate({"launch": {"n_servers": 0, "server_addrs": ["h:1"]}})
    assert check_launch(listed, environ={"AREALITE_SERVER_ADDRS": "other:2"}) == ["h:1"]
    high = ArealiteConfig.model_validate({"launch": {"n_servers": 4}, "server": {"base_port": 65534}})
    with pytest.raises(ConfigError, match="server.base_port = 65534"):
        check_launch(high, environ={})


def test_parse_args(tmp_path, capsys):
    path = write(tmp_path, "rollout: {consumer_batch_size: 4}\n")
    cfg = parse_args(["--config", str(path), "actor.optimizer.lr=2e-5"], check_paths=False)
    assert (cfg.rollout.consumer_batch_size, cfg.actor.optimizer.lr) == (4, 2e-5)
    assert parse_args(["data.shuffle=false"], check_paths=False).data.shuffle is False
    with pytest.raises(SystemExit) as info:
        parse_args(["--config", str(path), "rollout.consumer_batch_size=0"], check_paths=False, prog="train.py")
    assert info.value.code == 2
    assert "train.py: error:" in capsys.readouterr().err
    with pytest.raises(ConfigError):
        parse_args(["bad.key=1"], check_paths=False, exit_on_error=False)


# --------------------------------------------------------------------------- example, docs, CLI


def test_example_config_is_complete_and_valid():
    raw = yaml.safe_load(EXAMPLE.read_text())
    missing = []
    for dotted in leaf_paths():
        node = raw
        for part in dotted.split("."):
            if node is None and optional_section(dotted, part):
                break  # an optional section left null (e.g. `actor.lora: null`), its keys commented
            if not isinstance(node, dict) or part not in node:
                missing.append(dotted)
                break
            node = node[part]
    assert not missing, f"examples/configs/default.yaml lacks {missing}"
    cfg = load_config(EXAMPLE, check_paths=False)
    assert cfg.actor.model_path == "runs/demo/model"
    assert cfg.launch.server_backend == "embedded"


def test_config_reference_is_up_to_date():
    committed = (REPO / "docs" / "config_reference.md").read_text()
    assert committed == render_reference(), (
        f"docs/config_reference.md is stale; regenerate it with: {REGENERATE}"
    )
    for dotted in leaf_paths():
        assert f"`{dotted}`" in committed


def _cli(*args: str, cwd: Path = REPO, module: str = "arealite.config") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=60,
    )


def test_cli_show_and_schema():
    r = _cli("show", str(EXAMPLE), "actor.optimizer.lr=3e-5", "server.api_key=s3cret", "generation.n_samples=2")
    assert r.returncode == 0, r.stderr
    shown = yaml.safe_load(r.stdout)
    assert shown["actor"]["optimizer"]["lr"] == 3e-5
    assert shown["generation"]["n_samples"] == 2
    assert shown["server"]["api_key"] == "***" and "s3cret" not in r.stdout
    assert shown["actor"]["model_path"] == "runs/demo/model"

    r = _cli("schema")
    assert r.returncode == 0, r.stderr
    schema = json.loads(r.stdout)
    assert set(schema["properties"]) == set(ArealiteConfig.model_fields)


def test_cli_docs_matches_committed_reference():
    r = _cli("docs")
    assert r.returncode == 0, r.stderr
    assert r.stdout == (REPO / "docs" / "config_reference.md").read_text(), (
        f"docs/config_reference.md is stale; regenerate it with: {REGENERATE}"
    )


def _check_cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return _cli(*args, cwd=cwd, module="arealite.check")


def test_cli_check(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "p.jsonl").write_text('{"prompt": "x", "answer": "y"}\n')
    ok = _check_cli(str(EXAMPLE), f"actor.model_path={model}",
                    f"data.train_path={tmp_path}/p.jsonl", f"data.eval_path={tmp_path}/p.jsonl")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("OK:")

    # Run where the example's relative paths name nothing (the demo may have built runs/demo here).
    bad = _check_cli(str(EXAMPLE), "rollout.consumer_batch_size=0", cwd=tmp_path)
    assert bad.returncode == 1
    assert "rollout.consumer_batch_size = 0" in bad.stderr
    assert "actor.model_path = 'runs/demo/model'" in bad.stderr  # path checks are on
    assert "python -m arealite.models.tiny runs/demo/model" in bad.stderr

    # Names resolved by the packages above config are checked in the same round.
    names = _check_cli(str(EXAMPLE), "--no-paths", "algorithm.adv_estimator=grpoo", "rollout.workflow=nope",
                       "rollout.consumer_batch_size=0")
    assert names.returncode == 1
    for needle in ("algorithm.adv_estimator = 'grpoo'", "rollout.workflow = 'nope'", "rollout.consumer_batch_size = 0"):
        assert needle in names.stderr, names.stderr

    syntax = tmp_path / "broken.yaml"
    syntax.write_text("actor:\n  dtype: [\n")
    r = _check_cli(str(syntax))
    assert r.returncode == 1 and f"{syntax}:3:" in r.stderr
