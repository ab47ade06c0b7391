"""The tool-use demo's own files, end to end at toy size: `examples/tool_use/prepare.py`
builds a model whose tokenizer knows the tool-call markup and warms it up on traces rendered
as the endpoint renders them; `arealite.train` with `examples/tool_use/config.yaml` then runs
the agent of `examples/tool_use/agent.py` (written against `AsyncOpenAI`) through the endpoint.
The full demo (`bash ci/tool_demo.sh`, minutes) is what shows the learning; this checks that
its pieces fit: the warm-up traces match the endpoint's rendering, the calculator's answers,
and a short run with the tool calls counted and both evaluations written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_env

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))

from tool_use.agent import calculate, final_number, make_items, tool_result  # noqa: E402


@pytest.mark.parametrize("expr, value", [("1234 * 5678", "7006652"), ("(2 + 3) * 4", "20"), ("-7 // 2", "-4"),
                                         ("10 % 4", "2")])
def test_calculator_evaluates_integer_arithmetic(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os')", "2 ** 10", "1.5 * 2", "10000000000000 * 2", "1 // 0", "(" * 500])
def test_calculator_refuses_what_is_not_plain_integer_arithmetic(expr):
    assert calculate(expr).startswith("error:")


def test_tool_result_reports_bad_calls_as_text():
    assert tool_result("calculator", '{"expression": "6 * 7"}') == "42"
    assert tool_result("shell", "{}").startswith("error: unknown tool")
    assert tool_result("calculator", "not json").startswith("error: bad arguments")
    assert tool_result("calculator", '{"expr": "1"}').startswith("error: bad arguments")


def test_items_are_distinct_and_answers_are_products():
    items = make_items(300, seed=3)
    assert len({(i["a"], i["b"]) for i in items}) == 300
    assert all(i["answer"] == str(i["a"] * i["b"]) for i in items)
    held_out = {(i["a"], i["b"]) for i in make_items(50, seed=4)}
    assert not held_out & {(i["a"], i["b"]) for i in make_items(300, seed=3, exclude=held_out)}
    assert final_number("The answer is 7006652.") == "7006652" and final_number("no idea") is None


def test_warm_up_traces_are_the_endpoints_rendering(tmp_path):
    """A warm-up trace is, token for token, the conversation the endpoint builds from the
    same messages: the prompt with the tools, the reply, the tool turn, the answer."""
    from transformers import AutoTokenizer

    from arealite.agent.chat import ChatRenderer
    from arealite.models.tiny import build_tiny_model
    from tool_use.agent import TOOLS
    from tool_use.prepare import TraceBuilder, answer_text, tokenizer_corpus, tool_call_text

    path = build_tiny_model(tmp_path / "m", size="micro", extra_corpus=tokenizer_corpus(0, n=50))
    tok = AutoTokenizer.from_pretrained(path)
    item = make_items(1, seed=0)[0]
    ids, mask = TraceBuilder(tok).trace(item, "tool")
    r = ChatRenderer(tok)
    args = json.dumps({"expression": f"{item['a']} * {item['b']}"})
    msgs = [{"role": "user", "content": item["prompt"]},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": str(item["a"] * item["b"])},
            {"role": "assistant", "content": answer_text(item["a"] * item["b"])}]
    text = tok.decode(ids)
    assert text.startswith(tok.decode(r.prompt_ids(msgs[:1], TOOLS)))
    assert tool_call_text(item["a"], item["b"]) in text and text.rstrip().endswith(
        tok.decode(r.encode(answer_text(item["a"] * item["b"])) + [r.end_of_turn]).rstrip())
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    assert str(item["a"] * item["b"]) in trained and "What is" not in trained  # the prompt is never trained


@pytest.mark.slow
def test_tool_demo_runs_end_to_end_at_toy_size(tmp_path):
    data = tmp_path / "demo"
    subprocess.run([sys.executable, "examples/tool_use/prepare.py", "--out", str(data), "--size", "micro",
                    "--n-train", "200", "--n-eval", "8", "--warmup-steps", "30"],
                   cwd=REPO, env=run_env(), check=True, timeout=300, capture_output=True)
    runs = tmp_path / "runs"
    res = subprocess.run(
        [sys.executable, "-m", "arealite.train", "--config", str(REPO / "examples/tool_use/config.yaml"),
         f"experiment.output_root={runs}", "experiment.trial=t", f"actor.model_path={data / 'model'}",
         f"data.train_path={data / 'train.jsonl'}", f"data.eval_path={data / 'eval.jsonl'}",
         "data.max_train_steps=2", "rollout.consumer_batch_size=4", "generation.n_samples=4",
         "evaluation.freq_steps=null", "saver.export_hf_at_end=false", "stats.plot=false",
         "stats.progress_bar=false", "launch.n_trainer_procs=1"],
        cwd=tmp_path, env=run_env(REPO / "examples"), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = [json.loads(line) for line in (runs / "tool_use" / "t" / "stats.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[-1]["controller/workflow/agent_calls"] >= 2 * 4 * 4  # every episode called the model
    assert steps[-1]["controller/workflow/episodes"] >= 2 * 4 * 4
    assert sum(1 for r in records if "eval/accuracy" in r) == 2  # before and after RL
    assert "held-out greedy accuracy: before RL" in res.stdout
