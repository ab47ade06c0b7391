"""Bad input wherever it enters: config, dataset files, prompts, reward functions,
custom workflows, HTTP requests and secrets. Each case asserts the error type and
that the message names the field, row or key, and how to fix it where that helps.

Real components throughout: real JSONL files and tokenizers, a real embedded
server child process (micro model, started with an API key and no --host) for
every HTTP, reward and workflow case, the real training script and launcher.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from arealite.api.types import GenerationRequest, SamplingParams
from arealite.check import load_run_config
from arealite.config import ConfigError
from arealite.config.schema import ArealiteConfig, GenerationConfig, RolloutConfig
from arealite.data.dataset import DatasetError, DatasetRows, load_jsonl
from arealite.data.validate import SHOW_ROWS, validate_datasets, validate_prompts
from arealite.inference_client.sglang_client import SGLangClient
from arealite.rollout.controller import RolloutController, WorkflowError
from arealite.workflow.base import RolloutWorkflow
from arealite.workflow.common import encode_prompt
from arealite.workflow.rlvr import RLVRWorkflow

from conftest import REPO, free_port, stop_process

pytestmark = pytest.mark.timeout(180)

KEY = "sk-bad-input-7f3a9c"


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok(micro_model_dir):
    return AutoTokenizer.from_pretrained(micro_model_dir)


@pytest.fixture(scope="module")
def no_template_dir(micro_model_dir, tmp_path_factory) -> Path:
    """The micro model with the chat template removed from its tokenizer files."""
    d = tmp_path_factory.mktemp("no_template") / "model"
    shutil.copytree(micro_model_dir, d)
    (d / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    assert AutoTokenizer.from_pretrained(d).chat_template is None
    return d


# =========================================================================== config

# (overrides, field the error must name, text it must contain)
BAD_CONFIG = [
    (["server.context_length=100", "data.max_prompt_len=40", "data.eval_path=e.jsonl",
      "generation.max_new_tokens=50", "evaluation.max_new_tokens=80"],
     "evaluation.max_new_tokens", "data.max_prompt_len (40) + evaluation.max_new_tokens must fit in server.context_length"),
    (["launch.server_backend=sglang", "server.sglang.context_length=64", "generation.max_new_tokens=64"],
     "generation.max_new_tokens", "server.sglang.context_length = 64"),
    (["data.reward_fn=arealite.reward.math:no_such_fn"], "data.reward_fn", "no_such_fn"),
    (["data.reward_fn=arealite.reward.math"], "data.reward_fn", "string should match pattern"),
    (["server.api_key=''"], "server.api_key", "at least 1 character"),
    (["server.host=''"], "server.host", "at least 1 character"),
    (["rollout.on_reward_error=ignore"], "rollout.on_reward_error", "'zero' or 'reject'"),
    (["rollout.reward_timeout_s=0"], "rollout.reward_timeout_s", "greater than 0"),
    (["data.max_prompt_len=0"], "data.max_prompt_len", "greater than or equal to 1"),
    (["data.prompt_key=''"], "data.prompt_key", "at least 1 character"),
]


@pytest.mark.parametrize("overrides, field, needle", BAD_CONFIG, ids=[c[1] + "-" + str(i) for i, c in enumerate(BAD_CONFIG)])
def test_bad_config_names_the_field(overrides, field, needle):
    with pytest.raises(ConfigError) as info:
        load_run_config(None, overrides, check_paths=False)
    hits = [p.format() for p in info.value.problems if p.path == field]
    assert hits, f"no problem names {field}:\n{info.value}"
    assert any(needle.lower() in h.lower() for h in hits), hits


# =========================================================================== dataset files


@pytest.mark.parametrize("content, needle", [
    (b'{"prompt": "a", "answer": 1}\n{"prompt": "caf\xe9", "answer": 2}\n', r"d.jsonl:2: not valid UTF-8 \(byte 0xe9"),
    (b'{"prompt": "a", "answer": NaN}\n', r"d.jsonl:1: field 'answer' is nan"),
    (b'{"prompt": "a", "answer": 1}\n\n{"prompt": "b", "answer": -Infinity}\n', r"d.jsonl:3: field 'answer' is -inf"),
    (b'{"prompt": {"text": "a"}, "answer": 1}\n', r"d.jsonl:1: field 'prompt' must be .* got dict"),
    (b'{"prompt": [], "answer": 1}\n', r"d.jsonl:1: field 'prompt' must be a non-empty string or a list"),
    (b'{"prompt": [{"role": "user", "content": 3}], "answer": 1}\n', r"d.jsonl:1: field 'prompt'\[0\] must be a message"),
    (b'{"prompt": "a", "answer": true}\n', r"d.jsonl:1: field 'answer' must be a string or a number, got bool"),
    (b'{"prompt": "a", "answer": 1, "prompt_id": "7"}\n', r"d.jsonl:1: field 'prompt_id' must be an integer, got '7'"),
    (b'{"prompt": "   ", "answer": 1}\n', r"d.jsonl:1: field 'prompt' is an empty string"),
], ids=["utf8", "nan-answer", "inf-answer", "dict-prompt", "empty-messages", "content-type", "bool-answer",
        "string-id", "blank-prompt"])
def test_bad_rows_are_named_by_line(tmp_path, content, needle):
    p = tmp_path / "d.jsonl"
    p.write_bytes(content)
    with pytest.raises(DatasetError, match=needle):
        load_jsonl(p)


def test_custom_prompt_key_missing_says_which_setting(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": 1}])
    with pytest.raises(DatasetError, match=r":1: missing field 'problem' \(fields: \['answer', 'question'\]\); set data.prompt_key"):
        load_jsonl(p, prompt_key="problem")


# =========================================================================== prompts vs tokenizer and limits


def test_long_prompts_are_all_reported_with_line_length_and_count(tmp_path, tok):
    rows = [{"prompt": "ok", "answer": 1}] * 3 + [{"prompt": "x" * (50 + i), "answer": 1} for i in range(8)]
    rows.insert(2, "")  # a blank line: reported line numbers are the file's
    items = load_jsonl(write_jsonl(tmp_path / "t.jsonl", rows))
    n_long = len(tok.encode("x" * 50, add_special_tokens=False))
    with pytest.raises(DatasetError) as info:
        validate_prompts(items, tok, max_prompt_len=n_long - 1, dataset="data.train_path (t.jsonl)")
    msg = str(info.value)
    assert msg.startswith("data.train_path (t.jsonl): 8 of 11 prompts cannot be used:")
    assert f"t.jsonl:5 (prompt_id 3): {n_long} tokens > data.max_prompt_len = {n_long - 1}" in msg
    assert msg.count("tokens > data.max_prompt_len") == SHOW_ROWS
    assert f"... and {8 - SHOW_ROWS} more" in msg and "in all: 8 longer than data.max_prompt_len" in msg
    assert "raise data.max_prompt_len" in msg
    assert validate_prompts(items, tok, max_prompt_len=10_000)[0] == len(tok.encode("ok", add_special_tokens=False))


def test_prompt_plus_new_tokens_beyond_context_names_both(tmp_path, tok):
    items = load_jsonl(write_jsonl(tmp_path / "t.jsonl", [{"prompt": "hello", "answer": 1}, {"prompt": "y" * 40, "answer": 2}]))
    n = len(tok.encode("y" * 40, add_special_tokens=False))
    with pytest.raises(DatasetError) as info:
        validate_prompts(items, tok, context_length=n + 10, max_new_tokens=11, context_name="server.context_length")
    msg = str(info.value)
    assert f"t.jsonl:2 (prompt_id 1): {n} tokens + generation.max_new_tokens 11 = {n + 11} > server.context_length = {n + 10}" in msg
    assert "1 of 2 prompts" in msg and "lower generation.max_new_tokens" in msg


def test_chat_template_asked_but_missing_names_the_setting_and_tokenizer(tmp_path, no_template_dir):
    tok_nt = AutoTokenizer.from_pretrained(no_template_dir)
    items = load_jsonl(write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "answer": 1}]))
    with pytest.raises(DatasetError, match=rf"data.apply_chat_template is true but the tokenizer of {no_template_dir} "
                                           r"has no chat template.*data.apply_chat_template=false"):
        validate_prompts(items, tok_nt, apply_chat_template=True, tokenizer_path=no_template_dir)


def test_chat_messages_without_a_template_name_the_rows(tmp_path, no_template_dir):
    tok_nt = AutoTokenizer.from_pretrained(no_template_dir)
    msgs = [{"role": "user", "content": "hi"}]
    items = load_jsonl(write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a", "answer": 1}, {"prompt": msgs, "answer": 1}]))
    with pytest.raises(DatasetError, match=r"t.jsonl:2 \(prompt_id 1\): field 'prompt' holds chat messages but the "
                                           r"tokenizer of .* has no chat template"):
        validate_prompts(items, tok_nt)


def test_chat_template_tokens_count_towards_the_limit(tok):
    items = [{"prompt": "abcdef", "prompt_id": 0}]
    plain = validate_prompts(items, tok)[0]
    templated = validate_prompts(items, tok, apply_chat_template=True)[0]
    assert templated > plain
    with pytest.raises(DatasetError, match=rf"row 0 \(prompt_id 0\): {templated} tokens > data.max_prompt_len = {plain}"):
        validate_prompts(items, tok, apply_chat_template=True, max_prompt_len=plain)


@pytest.mark.parametrize("item, needle", [
    ({"input_ids": [1, 2, 10**6]}, r"row 0: field 'input_ids' must be a non-empty list of token ids in \[0, 512\)"),
    ({"input_ids": []}, r"row 0: field 'input_ids' must be a non-empty list"),
    ({"prompt": ""}, r"row 0: field 'prompt' encodes to no tokens"),
    ({"prompt": 3.5}, r"row 0: field 'prompt' must be a string or a list of chat messages, got float"),
    ({"text": "a"}, r"row 0: missing field 'prompt' \(fields: \['text'\]\); set data.prompt_key"),
    ("just a string", r"row 0: is a str, not a JSON object"),
], ids=["token-out-of-vocab", "no-tokens", "empty-prompt", "float-prompt", "missing-prompt", "not-a-dict"])
def test_items_built_in_code_are_checked_too(tok, item, needle):
    with pytest.raises(DatasetError, match=needle):
        validate_prompts([item], tok)


def test_no_prompts_at_all(tok):
    with pytest.raises(DatasetError, match="data.eval_path: no prompts"):
        validate_prompts([], tok, dataset="data.eval_path")


def test_lengths_match_what_the_workflow_sends(tok):
    items = [{"prompt": "What is 12 + 30?"}, {"prompt": [{"role": "user", "content": "hi"}]}, {"input_ids": [5, 6, 7]}]
    for chat in (False, True):
        lengths = validate_prompts(items, tok, apply_chat_template=chat)
        assert lengths == [len(encode_prompt(tok, it, "prompt", chat)[1]) for it in items]


def _cfg(tmp_path: Path, model_dir: Path, **sections) -> ArealiteConfig:
    data = {"train_path": str(tmp_path / "train.jsonl"), **sections.pop("data", {})}
    return ArealiteConfig.model_validate({"actor": {"model_path": str(model_dir)}, "data": data, **sections})


def test_context_defaults_to_the_models_max_positions(tmp_path, tok, micro_model_dir):
    max_pos = json.loads((micro_model_dir / "config.json").read_text())["max_position_embeddings"]
    long_text = "z" * (max_pos * 2)
    items = load_jsonl(write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "answer": 1}, {"prompt": long_text, "answer": 1}]))
    cfg = _cfg(tmp_path, micro_model_dir, rollout={"consumer_batch_size": 1})
    with pytest.raises(DatasetError, match=rf"train.jsonl:2 \(prompt_id 1\): \d+ tokens \+ generation.max_new_tokens 256 = "
                                           rf"\d+ > max_position_embeddings of {micro_model_dir}/config.json = {max_pos}"):
        validate_datasets(cfg, tok, items)


def test_eval_prompts_checked_against_eval_budget(tmp_path, tok, micro_model_dir):
    train = load_jsonl(write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "answer": 1}] * 2))
    rows = [{"prompt": "b", "answer": 1}, {"prompt": "q" * 30, "answer": 1}, {"prompt": "q" * 300, "answer": 1}]
    eval_items = load_jsonl(write_jsonl(tmp_path / "eval.jsonl", rows))[:2]  # as train.py slices to max_prompts
    assert isinstance(eval_items, DatasetRows)
    n = len(tok.encode("q" * 30, add_special_tokens=False))
    cfg = _cfg(tmp_path, micro_model_dir, data={"eval_path": str(tmp_path / "eval.jsonl")},
               server={"context_length": n + 19}, generation={"max_new_tokens": 10},
               evaluation={"max_new_tokens": 20}, rollout={"consumer_batch_size": 2})
    assert validate_datasets(cfg, tok, train)["train"] == [1, 1]  # the train set alone is fine
    with pytest.raises(DatasetError) as info:
        validate_datasets(cfg, tok, train, eval_items)
    msg = str(info.value)
    assert msg.startswith(f"data.eval_path ({tmp_path / 'eval.jsonl'}): 1 of 2 prompts cannot be used")
    assert f"eval.jsonl:2 (prompt_id 1): {n} tokens + evaluation.max_new_tokens 20 = {n + 20} > server.context_length = {n + 19}" in msg


def test_sglang_context_length_is_named(tmp_path, tok, micro_model_dir):
    items = load_jsonl(write_jsonl(tmp_path / "train.jsonl", [{"prompt": "w" * 20, "answer": 1}]))
    cfg = _cfg(tmp_path, micro_model_dir, launch={"server_backend": "sglang"}, server={"sglang": {"context_length": 16}},
               generation={"max_new_tokens": 4}, rollout={"consumer_batch_size": 1})
    with pytest.raises(DatasetError, match=r"> server.sglang.context_length = 16"):
        validate_datasets(cfg, tok, items)


def test_fewer_prompts_than_a_batch(tmp_path, tok, micro_model_dir):
    items = load_jsonl(write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "answer": 1}] * 3))
    cfg = _cfg(tmp_path, micro_model_dir, rollout={"consumer_batch_size": 4})
    with pytest.raises(DatasetError, match=r"has 3 prompts, fewer than one batch: rollout.consumer_batch_size = 4 "
                                           r"over 2 trainer rank\(s\) needs at least 4"):
        validate_datasets(cfg, tok, items, world_size=2)


# =========================================================================== the training script, end to end


@pytest.mark.slow
@pytest.mark.parametrize("rows, needle", [
    ([{"prompt": "fine", "answer": 1}] * 3 + [{"prompt": "p" * 200, "answer": 2}],
     r"train.jsonl:4 \(prompt_id 3\): \d+ tokens > data.max_prompt_len = 32"),
    ([{"prompt": "fine", "answer": 1}, {"prompt": "no answer"}], r"train.jsonl:2: missing field 'answer'"),
], ids=["too-long", "missing-field"])
def test_training_script_stops_on_bad_data_before_anything_starts(tmp_path, micro_model_dir, rows, needle):
    """examples/rlvr/train.py, no launcher, server address pointing at a socket that must stay untouched."""
    write_jsonl(tmp_path / "train.jsonl", rows)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    env = dict(os.environ, AREALITE_SERVER_ADDRS=f"127.0.0.1:{port}", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, str(REPO / "examples/rlvr/train.py"),
           f"actor.model_path={micro_model_dir}", f"data.train_path={tmp_path / 'train.jsonl'}",
           "data.max_prompt_len=32", "rollout.consumer_batch_size=2", "generation.max_new_tokens=8",
           f"experiment.output_root={tmp_path / 'runs'}", "stats.progress_bar=false"]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing connected: the server was never contacted
    finally:
        listener.close()
    assert proc.returncode != 0
    assert "DatasetError" in proc.stderr
    assert re.search(needle, proc.stderr), proc.stderr[-3000:]
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "runs" / "arealite" / "trial0" / "checkpoints").exists()


# =========================================================================== the embedded server: bind address, API key


@pytest.fixture(scope="module")
def server(micro_model_dir, tmp_path_factory):
    """A real server started the way a user would, with an API key and no --host."""
    port = free_port()
    log = tmp_path_factory.mktemp("bad_input_server") / "server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "arealite.server", "--model-path", str(micro_model_dir), "--port", str(port),
             "--api-key", KEY, "--log-level", "debug"],
            stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "server never became healthy"
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.2)
        yield {"url": url, "port": port, "addr": f"127.0.0.1:{port}", "log": log, "proc": proc}
    finally:
        stop_process(proc, 15)


def http(server, path, body=None, key=None, headers=None, method=None):
    """(status, parsed JSON body) of one request; ``key`` is sent as a Bearer token."""
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(server["url"] + path, data=data, headers=h, method=method or ("POST" if data else "GET"))
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw.decode(errors="replace")


def test_server_binds_to_loopback_by_default(server):
    port_hex = f"{server['port']:04X}"
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if local.endswith(":" + port_hex) and state == "0A":  # 0A = LISTEN
                listening.append(local.split(":")[0])
    assert listening == ["0100007F"], f"listening on {listening}, expected 127.0.0.1 only"
    assert http(server, "/get_server_info", key=KEY)[1]["host"] == "127.0.0.1"


def test_launcher_and_config_default_to_loopback():
    from arealite.server.command_line import embedded_server_command, sglang_server_command

    cfg = ArealiteConfig.model_validate({"actor": {"model_path": "/m"}})
    for cmd in (embedded_server_command(cfg, 1234), sglang_server_command(cfg, 1234)):
        assert cmd[cmd.index("--host") + 1] == "127.0.0.1"


STATE_ROUTES = [
    ("/pause_generation", {"mode": "abort"}),
    ("/continue_generation", {}),
    ("/abort_request", {"rid": "x", "abort_all": True}),
    ("/flush_cache", {}),
    ("/update_weights_from_disk", {"model_path": "/tmp", "weight_version": "99"}),
    ("/update_weights_from_shm", {"path": "/dev/shm/w", "names": ["w"], "dtypes": ["float32"], "shapes": [[1]],
                                  "offsets": [0], "weight_version": "99"}),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                    "world_size": 2, "group_name": "g", "backend": "gloo"}),
    ("/update_weights_from_distributed", {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"}),
    ("/destroy_weights_update_group", {"group_name": "g"}),
    ("/begin_weight_update", {}),
    ("/end_weight_update", {}),
    ("/update_weight_version", {"new_version": "99"}),
    ("/get_weights_by_name", {"name": "lm_head.weight"}),
]


@pytest.mark.parametrize("path, body", STATE_ROUTES, ids=[p.strip("/") for p, _ in STATE_ROUTES])
@pytest.mark.parametrize("auth", [None, "Bearer wrong-key", f"Basic {KEY}", f"Bearer {KEY[:-1]}", KEY],
                         ids=["none", "wrong", "basic", "key-prefix", "no-scheme"])
def test_state_changing_routes_refuse_without_the_key(server, path, body, auth):
    headers = {"Authorization": auth} if auth else {}
    status, resp = http(server, path, body, headers=headers)
    assert status == 401, (path, status, resp)
    assert "Bearer" in str(resp) and KEY not in str(resp)  # says what to send, never echoes the key


def test_refused_requests_change_nothing(server):
    for path, body in STATE_ROUTES:
        assert http(server, path, body)[0] == 401
    assert http(server, "/flush_cache", method="GET")[0] == 401
    info = http(server, "/get_server_info", key=KEY)[1]
    assert str(info.get("weight_version")) != "99"
    # not paused: an authorised generation completes at once
    t0 = time.monotonic()
    status, out = http(server, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}, key=KEY)
    assert status == 200 and len(out["output_ids"]) <= 4 and time.monotonic() - t0 < 10


@pytest.mark.parametrize("auth", [None, "Bearer wrong-key"], ids=["none", "wrong"])
def test_generate_refuses_without_the_key_and_generates_nothing(server, auth):
    def generated() -> int:
        return http(server, "/get_server_info", key=KEY)[1]["internal_states"][0]["generated_tokens"]

    before = generated()
    headers = {"Authorization": auth} if auth else {}
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    status, resp = http(server, "/generate", body, headers=headers)
    assert status == 401, resp
    assert "output_ids" not in str(resp) and KEY not in str(resp)
    assert generated() == before


def test_key_as_query_parameter_is_not_accepted(server):
    status, _ = http(server, f"/pause_generation?api_key={KEY}", {"mode": "abort"})
    assert status == 401


async def test_client_with_a_wrong_key_fails_without_showing_either_key(server):
    wrong = "sk-wrong-0b1d"
    client = SGLangClient([server["addr"]], RolloutConfig(request_retries=0, request_timeout_s=10), api_key=wrong)
    try:
        with pytest.raises(Exception) as info:
            await client.initialize(timeout=10)
            await client.agenerate(GenerationRequest(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=2)))
        text = f"{info.value!r} {info.value} {client!r} {client.stats()}"
        assert "401" in text or "unauthorized" in text.lower(), text
        assert wrong not in text and KEY not in text
    finally:
        await client.aclose()


def test_server_log_never_shows_the_key(server):
    # a failed weight update and a bad request, with the key, at debug level: the log still hides it
    assert http(server, "/update_weights_from_disk", {"model_path": "/nonexistent", "weight_version": "1"}, key=KEY)[0] == 400
    assert http(server, "/generate", {"input_ids": "bad"}, key=KEY)[0] == 400
    log = server["log"].read_text()
    assert "update_weights_from_disk" in log or "nonexistent" in log or log, "the server logged nothing"
    assert KEY not in log


# =========================================================================== reward functions over the real path


def _controller(server, **rc) -> RolloutController:
    cfg = RolloutConfig(**{"consumer_batch_size": 1, "max_head_offpolicyness": 1000, "request_timeout_s": 30,
                           "request_retries": 0, **rc})
    client = SGLangClient([server["addr"]], cfg, api_key=KEY)
    return RolloutController(client, cfg).start(init_timeout=30)


def _reward_none(*a, **k):
    return None


def _reward_inf(*a, **k):
    return float("inf")


def _reward_list(*a, **k):
    return [1.0]


def _reward_tensor2(*a, **k):
    return torch.tensor([1.0, 0.0])


def _reward_raises_on_odd(*a, prompt_id=0, **k):
    if prompt_id % 2:
        raise KeyError("answer")
    return 1.0


def _reward_by_prompt(*a, prompt_id=0, **k):
    """A different failure per prompt: the run must go on through all of them."""
    if prompt_id == 0:
        raise RuntimeError("grader crashed")
    if prompt_id == 1:
        return float("nan")
    if prompt_id == 2:
        return "0.5"
    if prompt_id == 3:
        time.sleep(5)
    return 1.0


@pytest.mark.parametrize("fn, returned", [
    (_reward_none, "returned NoneType"), (_reward_inf, "returned inf"), (_reward_list, "returned list"),
    (_reward_tensor2, "returned Tensor"), (_reward_raises_on_odd, "raised KeyError"),
], ids=["none", "inf", "list", "2-element-tensor", "raises-on-some"])
def test_bad_rewards_over_http_are_zeroed_counted_and_logged(server, tok, caplog, fn, returned):
    ctl = _controller(server)
    try:
        wf = RLVRWorkflow(fn, GenerationConfig(n_samples=2, max_new_tokens=3), tok, ctl.config)
        with caplog.at_level(logging.WARNING):
            batch = ctl.rollout_batch([{"prompt": "a", "prompt_id": 0}, {"prompt": "b", "prompt_id": 1}], wf)
        n_bad = 2 if fn is _reward_raises_on_odd else 4
        expected = [1.0, 1.0, 0.0, 0.0] if fn is _reward_raises_on_odd else [0.0] * 4
        order = batch["prompt_id"].argsort(stable=True)
        assert batch["rewards"][order].tolist() == expected
        assert ctl.stats()["workflow/reward_errors"] == n_bad
        assert any(returned in r.getMessage() and fn.__name__ in r.getMessage() for r in caplog.records), \
            [r.getMessage() for r in caplog.records]
    finally:
        ctl.stop()


def test_a_mix_of_reward_failures_with_reject_policy_keeps_the_run_going(server, tok):
    ctl = _controller(server, reward_timeout_s=0.5, on_reward_error="reject", consumer_batch_size=2)
    try:
        wf = RLVRWorkflow(_reward_by_prompt, GenerationConfig(n_samples=2, max_new_tokens=3), tok, ctl.config)
        items = [{"prompt": f"q{i}", "prompt_id": i} for i in range(6)]
        t0 = time.monotonic()
        for it in items:
            ctl.submit(it, wf)
        batch = ctl.wait(2, timeout=30)
        assert time.monotonic() - t0 < 15, "a hanging reward must not hold the run"
        assert sorted(set(batch["prompt_id"].tolist())) == [4, 5] and batch["rewards"].tolist() == [1.0] * 4
        st = ctl.stats()
        assert st["workflow/reward_errors"] == 8 and st["workflow/reward_rejected_groups"] == 4
    finally:
        ctl.stop()


# =========================================================================== malformed trajectories from a custom workflow


class Corrupting(RolloutWorkflow):
    """A real RLVR episode over HTTP whose TensorDict is then broken by ``breaker``."""

    def __init__(self, inner: RLVRWorkflow, breaker):
        self.inner, self.breaker = inner, breaker

    async def arun_episode(self, client, item):
        td = await self.inner.arun_episode(client, item)
        return self.breaker(td)


BREAKERS = [
    (lambda td: td.set("input_ids", td["input_ids"].int()), "key 'input_ids' has dtype torch.int32, expected torch.int64"),
    (lambda td: td.set("loss_mask", td["loss_mask"][:, :-1]), "key 'loss_mask' has length"),
    (lambda td: td.exclude("group_id"), "missing key 'group_id'"),
    (lambda td: td.set("rewards", td["rewards"][:, None]), "key 'rewards' has shape"),
    (lambda td: td.set("logprobs", td["logprobs"].half()), "key 'logprobs' has dtype torch.float16"),
    (lambda td: [td], "expected a TensorDict (or None to reject), got list"),
]


@pytest.mark.parametrize("breaker, needle", BREAKERS,
                         ids=["int32-ids", "short-mask", "no-group-id", "2d-rewards", "half-logprobs", "list"])
def test_malformed_trajectory_from_a_real_episode_is_rejected_naming_the_key(server, tok, breaker, needle):
    ctl = _controller(server)
    try:
        inner = RLVRWorkflow(lambda *a, **k: 1.0, GenerationConfig(n_samples=2, max_new_tokens=3), tok, ctl.config)
        ctl.submit({"prompt": "hi", "prompt_id": 5}, Corrupting(inner, breaker))
        with pytest.raises(WorkflowError) as info:
            ctl.wait(1, timeout=30)
        assert needle in str(info.value) and "'prompt_id': 5" in str(info.value)
    finally:
        ctl.stop()


def test_malformed_trajectories_with_drop_policy_are_counted_and_the_run_goes_on(server, tok):
    ctl = _controller(server, on_workflow_error="drop")
    try:
        inner = RLVRWorkflow(lambda *a, **k: 1.0, GenerationConfig(n_samples=2, max_new_tokens=3), tok, ctl.config)
        bad = Corrupting(inner, BREAKERS[0][0])
        ctl.submit({"prompt": "x", "prompt_id": 0}, bad)
        ctl.submit({"prompt": "y", "prompt_id": 1}, inner)
        batch = ctl.wait(1, timeout=30)
        assert batch["prompt_id"].tolist() == [1, 1] and ctl.stats()["failed"] == 1
    finally:
        ctl.stop()


# =========================================================================== the API key through a launcher run

# A trivial training script that does what a real one does with the key: parses the
# config, builds the client, generates, pauses and resumes, hits a bad request, and
# logs at DEBUG level all along (aiohttp and arealite loggers included).
KEY_SCRIPT = r"""
import asyncio, logging, sys
logging.basicConfig(level=logging.DEBUG)
from arealite.api.types import GenerationRequest, SamplingParams
from arealite.config.loader import dump_config, parse_args
from arealite.config.run import server_addrs, server_api_key
from arealite.inference_client.sglang_client import SGLangClient

cfg = parse_args(sys.argv[1:], check_paths=False)
print(dump_config(cfg), flush=True)

async def main():
    client = SGLangClient(server_addrs(cfg), cfg.rollout, api_key=server_api_key(cfg))
    await client.initialize(timeout=30)
    out = await client.agenerate(GenerationRequest(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=3)))
    print("generated", out.output_ids, repr(client), client.stats(), flush=True)
    await client.pause_generation()
    await client.continue_generation()
    try:
        await client.agenerate(GenerationRequest(input_ids=[10**6], sampling=SamplingParams(max_new_tokens=3)))
    except Exception as e:
        print("bad request:", repr(e), flush=True)
    await client.aclose()

asyncio.run(main())
print("script done", flush=True)
"""


@pytest.fixture(scope="module")
def key_launch(micro_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("key_launch")
    (tmp / "train.py").write_text(KEY_SCRIPT)
    (tmp / "cfg.yaml").write_text(
        f"experiment: {{output_root: {tmp / 'runs'}, name: exp, trial: t1}}\n"
        f"actor: {{model_path: {micro_model_dir}}}\n"
        "launch: {n_servers: 1, server_startup_timeout_s: 120}\n"
        "rollout: {request_retries: 0}\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", AREALITE_LAUNCHER_GRACE_S="5", PYTHONPATH=str(REPO))
    env.pop("AREALITE_SERVER_ADDRS", None)
    env.pop("AREALITE_SERVER_API_KEY", None)
    proc = subprocess.run(
        [sys.executable, "-m", "arealite.launcher.local", str(tmp / "train.py"), "--config", str(tmp / "cfg.yaml"),
         f"server.api_key={KEY}"],
        capture_output=True, text=True, env=env, cwd=tmp, timeout=170)
    logs = tmp / "runs" / "exp" / "t1" / "logs"
    return {"proc": proc, "server": (logs / "server0.log").read_text(), "trainer": (logs / "trainer.log").read_text(),
            "run_dir": tmp / "runs"}


@pytest.mark.slow
def test_launcher_run_with_a_key_works_and_keeps_it_out_of_its_output(key_launch):
    proc = key_launch["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "script done" in key_launch["trainer"] and "generated" in key_launch["trainer"]
    assert "bad request:" in key_launch["trainer"]  # the key-carrying error path ran
    # The launcher keeps the key override off the trainer's command line (it arrives in
    # AREALITE_SERVER_API_KEY), so the dumped config holds no key, masked or not.
    assert "api_key: null" in key_launch["trainer"] or "api_key: '***'" in key_launch["trainer"]
    assert KEY not in proc.stdout and KEY not in proc.stderr
    assert KEY not in key_launch["server"]
    for f in key_launch["run_dir"].rglob("*"):
        if f.is_file() and f.name != "trainer.log":
            assert KEY.encode() not in f.read_bytes(), f


@pytest.mark.slow
def test_trainer_log_never_shows_the_key_outside_the_launchers_command_line(key_launch):
    lines = [ln for ln in key_launch["trainer"].splitlines() if not ln.startswith("[launcher] ")]
    assert len(lines) > 5 and not [ln for ln in lines if KEY in ln]


@pytest.mark.slow
def test_trainer_log_command_line_masks_the_key(key_launch):
    assert KEY not in key_launch["trainer"]


def test_stats_logger_never_sends_the_key_to_wandb(tmp_path, monkeypatch):
    """W&B uploads the run config; a stand-in module records what it was given (no network here)."""
    import types

    from arealite.trainer.stats_logger import StatsLogger

    given = {}

    class Run:
        def log(self, *a, **k):
            pass

        def finish(self):
            pass

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: given.update(kw) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = ArealiteConfig.model_validate({"server": {"api_key": KEY}, "stats": {"wandb": {"mode": "offline"}}})
    full = cfg.model_dump(mode="json")
    StatsLogger(tmp_path, cfg.stats, full_config=full).close()
    assert given["config"]["server"]["api_key"] == "***" and KEY not in json.dumps(given, default=str)
    assert full["server"]["api_key"] == KEY  # the caller's dict is left as it was
