"""The LLM judge: a separate embedded inference server grades answers with a rubric prompt."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from arealite.config.agent import JudgeConfig
from arealite.reward import judge as judge_mod
from arealite.reward.judge import Judge, judge_reward

from conftest import free_port


@pytest.fixture(scope="module")
def judge_server(micro_model_dir):
    from arealite.server.process import ServerProcess

    proc = ServerProcess(micro_model_dir, free_port(), threads=1, extra_args=["--random-seed", "0"])
    try:
        yield proc.wait_healthy(120)
    finally:
        proc.stop()


def test_scores_are_parsed_from_the_reply_and_scaled(micro_model_dir):
    j = Judge(JudgeConfig(max_score=10), addrs=["127.0.0.1:1"], tokenizer=AutoTokenizer.from_pretrained(micro_model_dir))
    assert j.parse("Reasoning... Score: 7") == 0.7
    assert j.parse("Score: 3, no wait, Score = 10") == 1.0  # the last score wins
    assert j.parse("Score: 15") == 1.0 and j.parse("Score: -2") == 0.0  # clipped to [0, 1]
    assert j.parse("I refuse to grade") is None
    ids = j.prompt_ids("What is 2+2?", "4", "4")
    text = j.tok.decode(ids)
    assert text.startswith("<|im_start|>user\n") and "Answer: 4" in text and "integer from 0 to 10" in text


def test_judge_grades_on_a_real_server(judge_server, micro_model_dir):
    tok = AutoTokenizer.from_pretrained(micro_model_dir)
    # a dead server first: the judge moves on to the live one
    j = Judge(JudgeConfig(max_new_tokens=8, timeout_s=5), addrs=["127.0.0.1:1", judge_server.url], tokenizer=tok)
    scores = [j.score("What is 2+2?", "4", "4") for _ in range(2)]
    assert all(0.0 <= s <= 1.0 for s in scores)
    assert j.counters["judged"] == 2 and j.counters["server_errors"] >= 1
    # a tiny random model rarely writes "Score: N": such replies score 0 and are counted
    assert j.counters["unparsable"] <= sum(s == 0.0 for s in scores)


def test_judge_reward_uses_the_configured_judge(judge_server, micro_model_dir, monkeypatch):
    monkeypatch.setenv(judge_mod.ADDRS_ENV, judge_server.url.removeprefix("http://"))
    judge_mod.configure(JudgeConfig(model_path=str(micro_model_dir), max_new_tokens=4))
    try:
        r = judge_reward("What is 2+2?", "4", [], [], answer=4, prompt_id=1)
        assert 0.0 <= r <= 1.0 and judge_mod._DEFAULT.counters["judged"] == 1
    finally:
        judge_mod.configure(JudgeConfig())


def test_no_judge_configured_says_how_to_set_one(monkeypatch):
    monkeypatch.delenv(judge_mod.ADDRS_ENV, raising=False)
    with pytest.raises(ValueError, match="agent.judge.addrs"):
        Judge(JudgeConfig())


def test_every_server_failing_is_an_error(micro_model_dir):
    j = Judge(JudgeConfig(timeout_s=2), addrs=["127.0.0.1:1"], tokenizer=AutoTokenizer.from_pretrained(micro_model_dir))
    with pytest.raises(RuntimeError, match="every judge server failed: http://127.0.0.1:1"):
        j.score("q", "a")
