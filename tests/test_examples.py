"""The example workflow (examples/custom_workflow.py), as a user would run it: named in
the config, built from it, and run through the controller against the embedded server
on the tiny model (real HTTP). Its trajectories must be exactly what the chat template
renders plus what the server generated, trained only on the generated tokens."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from arealite.api.types import validate_trajectory
from arealite.config.schema import ArealiteConfig, GenerationConfig, RolloutConfig
from arealite.reward.math import math_reward

from conftest import REPO, RecordingClient

EXAMPLE = REPO / "examples" / "custom_workflow.py"
SPEC = "examples.custom_workflow:AnswerThenCheck"


@pytest.fixture
def on_repo_path(monkeypatch):
    """The repository root on sys.path, as when a run starts from it."""
    monkeypatch.syspath_prepend(str(REPO))


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


Recorder = RecordingClient  # (conftest)


def test_example_stands_alone():
    """Nothing from tests/, no sys.path edits, no hard-coded chat tokens."""
    source = EXAMPLE.read_text()
    tree = ast.parse(source)
    modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in modules if m and (m == "tests" or m.startswith(("tests.", "conftest")))]
    assert "sys.path" not in source
    assert "<|im_start|>" not in source and "<|im_end|>" not in source


def test_example_is_built_from_config_by_name(on_repo_path, micro_model_dir):
    from arealite.workflow.registry import build_workflow, resolve_workflow_class

    tok = AutoTokenizer.from_pretrained(micro_model_dir)
    cls = resolve_workflow_class(SPEC)
    cfg = ArealiteConfig(rollout={"workflow": SPEC, "workflow_kwargs": {"check_prompt": "Only the number."}},
                         generation={"n_samples": 3})
    wf = build_workflow(cfg, tok)
    assert type(wf) is cls and wf.check_prompt == "Only the number." and wf.n == 3
    bad = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"workflow_kwargs": {"check": "x"}})})
    with pytest.raises(ValueError, match="workflow_kwargs.check is not a parameter of AnswerThenCheck"):
        build_workflow(bad, tok)


@pytest.mark.slow
def test_example_trajectories_are_template_plus_generated_tokens(on_repo_path, server, tiny_model_dir):
    from arealite.inference_client.sglang_client import SGLangClient
    from arealite.rollout.controller import RolloutController
    from arealite.utils.imports import import_callable

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    check_prompt = "Restate only the number."
    rc = RolloutConfig(consumer_batch_size=2, max_head_offpolicyness=1)
    wf = import_callable(SPEC)(tokenizer=tok, generation=GenerationConfig(n_samples=2, max_new_tokens=6),
                               rollout=rc, reward_fn=math_reward, check_prompt=check_prompt)
    items = [{"prompt": "What is 2 + 3?", "answer": 5, "prompt_id": 0},
             {"prompt": "What is 7 - 4?", "answer": 3, "prompt_id": 1}]
    rec = Recorder(SGLangClient([server.url], rc))  # workflows reach the client through the controller
    ctl = RolloutController(rec, rc).start(init_timeout=60)
    try:
        batch = ctl.rollout_batch(items, wf)
    finally:
        ctl.stop()
    validate_trajectory(batch)
    assert batch.batch_size[0] == 4 and len(rec.calls) == 8
    assert set(batch["rewards"].tolist()) <= {0.0, 0.5, 1.0}
    assert (batch["loss_mask"] <= batch["attention_mask"]).all()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = {}
    for it in items:
        text = tok.apply_chat_template([{"role": "user", "content": it["prompt"]}], add_generation_prompt=True,
                                       tokenize=False)
        prompts[tuple(tok.encode(text, add_special_tokens=False))] = it
    for row in range(4):
        ids = batch["input_ids"][row][batch["attention_mask"][row]].tolist()
        # The row's two turns: the calls whose request and output begin it, the prompt first.
        mine = [(i, c) for i, c in rec.calls if ids[: len(i) + len(c.output_ids)] == i + c.output_ids]
        (first_req, first), (second_req, second) = min(mine, key=lambda x: len(x[0])), max(mine, key=lambda x: len(x[0]))
        assert tuple(first_req) in prompts  # the first request is the chat-template prompt
        item = prompts[tuple(first_req)]
        check = second_req[len(first_req) + len(first.output_ids):]
        # Tokens: exactly the prompt, what the server generated, the check turn, what it generated.
        assert ids == first_req + first.output_ids + check + second.output_ids
        assert second_req == first_req + first.output_ids + check
        # The check turn is what the chat template renders between the two assistant turns.
        answer = first.output_ids[:-1] if first.output_ids[-1:] == [im_end] else first.output_ids
        conversation = tok.apply_chat_template(
            [{"role": "user", "content": item["prompt"]},
             {"role": "assistant", "content": tok.decode(answer, skip_special_tokens=False)},
             {"role": "user", "content": check_prompt}],
            add_generation_prompt=True, tokenize=False)
        assert tok.decode(second_req, skip_special_tokens=False) == conversation
        # Trained on the generated tokens only, with the server's log-probs and version.
        generated = ([False] * len(first_req) + [True] * len(first.output_ids) + [False] * len(check)
                     + [True] * len(second.output_ids))
        assert batch["loss_mask"][row][: len(ids)].tolist() == generated
        assert not batch["loss_mask"][row][len(ids):].any()
        lm = batch["loss_mask"][row]
        assert torch.allclose(batch["logprobs"][row][lm],
                              torch.tensor(first.output_logprobs + second.output_logprobs))
        assert (batch["versions"][row][lm] == 0).all() and (batch["versions"][row][~lm] == -1).all()
        # Scored with the run's reward function: answer right -> 0.5, and restated right -> 1.0.
        r1 = math_reward("", tok.decode(first.output_ids, skip_special_tokens=True), answer=item["answer"])
        r2 = math_reward("", tok.decode(second.output_ids, skip_special_tokens=True), answer=item["answer"])
        assert batch["rewards"][row].item() == r1 * (0.5 + 0.5 * r2)
    assert wf.stats()["reward_errors"] == 0


def test_example_main_runs_as_a_script_help():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(EXAMPLE), "--help"], capture_output=True, text=True, timeout=120,
                         cwd=Path("/"))
    assert out.returncode == 0, out.stderr
    assert "answer, then check" in out.stdout


def test_gsm8k_recipe_prepares_rows_the_loader_accepts(tmp_path):
    """examples/gsm8k: prepare_data.py turns the official format into rows that load_items
    and the prompt checks accept, and the recipe's config is valid (paths aside)."""
    import json
    import subprocess
    import sys

    from arealite.config.loader import load_config
    from arealite.data.dataset import load_items

    src = tmp_path / "gsm8k.jsonl"
    src.write_text("".join(json.dumps({"question": f"What is {a} + {b}?", "answer": f"{a} plus {b} #### {a + b:,}"})
                           + "\n" for a, b in [(2, 3), (1200, 34)]))
    out = tmp_path / "rows.jsonl"
    res = subprocess.run([sys.executable, "examples/gsm8k/prepare_data.py", "--input", str(src), "--output", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "wrote 2 rows" in res.stdout, res.stderr
    rows = load_items(out, "prompt", "answer")
    assert [r["answer"] for r in rows] == ["5", "1234"]
    assert rows[0]["prompt"][0]["role"] == "user" and "\\boxed{}" in rows[0]["prompt"][0]["content"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    res = subprocess.run([sys.executable, "examples/gsm8k/prepare_data.py", "--input", str(bad), "--output",
                          str(tmp_path / "x.jsonl")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "bad.jsonl:1" in res.stderr
    cfg = load_config(REPO / "examples/gsm8k/config.yaml", check_paths=False)
    assert cfg.launch.server_backend == "sglang" and cfg.rollout.workflow == "rlvr"
