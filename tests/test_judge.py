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


# ---------------------------------------------------------------- judge servers the launcher starts

def test_launched_judges_are_checked_and_get_their_own_model():
    from arealite.config.schema import ArealiteConfig
    from arealite.server.command_line import judge_server_command
    from arealite.launcher.slurm import check_slurm

    with pytest.raises(ValueError, match="agent.judge.n_servers=2 needs agent.judge.model_path"):
        ArealiteConfig.model_validate({"agent": {"judge": {"n_servers": 2}}})
    with pytest.raises(ValueError, match="agent.judge.addrs names some too"):
        ArealiteConfig.model_validate({"agent": {"judge": {"n_servers": 1, "model_path": "/j", "addrs": ["h:1"]}}})
    cfg = ArealiteConfig.model_validate({"actor": {"model_path": "/policy"}, "server": {"dtype": "float32"},
                                         "agent": {"judge": {"n_servers": 1, "model_path": "/judge"}}})
    cmd = judge_server_command(cfg, 4321, 0)
    assert cmd[cmd.index("--model-path") + 1] == "/judge" and cmd[cmd.index("--port") + 1] == "4321"
    assert cmd[cmd.index("--weight-version") + 1] == "0" and cmd[cmd.index("--dtype") + 1] == "float32"
    with pytest.raises(ValueError, match="agent.judge.n_servers: the Slurm launcher does not start"):
        check_slurm(cfg)


JUDGE_SCRIPT = r'''
import json, os
from arealite.config.agent import JudgeConfig
from arealite.reward import judge
judge.configure(JudgeConfig(model_path=os.environ["JUDGE_MODEL"], max_new_tokens=4, api_key="judgekey", timeout_s=30))
score = judge.judge_reward("What is 2+2?", "4", answer="4")
rec = {"judges": os.environ["AREALITE_JUDGE_ADDRS"].split(","), "policy": os.environ["AREALITE_SERVER_ADDRS"],
       "score": score, **judge._DEFAULT.counters, "pid": os.getpid()}
open(os.environ["OUT_FILE"], "w").write(json.dumps(rec))
'''


@pytest.mark.slow
def test_the_local_launcher_starts_judge_servers_and_hands_them_to_the_reward(tmp_path, micro_model_dir):
    import json
    import re
    import subprocess
    import sys
    import time

    import yaml

    from conftest import run_env

    (tmp_path / "train.py").write_text(JUDGE_SCRIPT)
    cfg = {"experiment": {"output_root": str(tmp_path / "runs"), "name": "exp", "trial": "t"},
           "actor": {"model_path": str(micro_model_dir)},
           "server": {"api_key": "policykey"},
           "launch": {"n_servers": 1, "server_startup_timeout_s": 120},
           "agent": {"judge": {"n_servers": 2, "model_path": str(micro_model_dir), "api_key": "judgekey"}}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "record.json"
    env = run_env(OUT_FILE=str(out), JUDGE_MODEL=str(micro_model_dir), AREALITE_LAUNCHER_GRACE_S="5")
    env.pop("AREALITE_JUDGE_ADDRS", None)
    res = subprocess.run([sys.executable, "-m", "arealite.launcher.local", str(tmp_path / "train.py"),
                          "--config", str(tmp_path / "cfg.yaml")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert len(rec["judges"]) == 2 and len(set(rec["judges"])) == 2 and rec["policy"] not in rec["judges"]
    # graded by the launched judges, with the judges' key (the policy's would be refused: an error)
    assert rec["judged"] == 1 and rec["server_errors"] == 0 and 0.0 <= rec["score"] <= 1.0
    logs = tmp_path / "runs" / "exp" / "t" / "logs"
    for i in range(2):
        text = (logs / f"judge{i}.log").read_text()
        assert f"--model-path {micro_model_dir}" in text and "judgekey" not in text and "policykey" not in text
    pids = [int(p) for p in re.findall(r"started \w+ \(pid (\d+)\)", res.stderr)]
    assert len(pids) == 4  # server0, judge0, judge1, trainer
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "a judge server outlived the launcher"


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, OSError):
        return False
