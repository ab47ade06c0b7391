"""Agentic RL pieces on their own: tool-call parsing, request validation and sampling limits,
incremental chat rendering, episode rows and rewards (no server; the tiny tokenizer)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from arealite.agent.chat import ChatRenderer, normalize_messages
from arealite.agent.errors import RequestError
from arealite.agent.protocol import SamplingPolicy, parse_request
from arealite.agent.session import LLMCall, SessionStore
from arealite.agent.tool_parsers import HermesToolParser, make_tool_parser
from arealite.agent.trajectory import call_returns, episode_rows, with_routed_experts
from arealite.api.types import Completion, SamplingParams
from arealite.config.agent import AgentConfig, JudgeConfig, SandboxConfig
from arealite.agent.workflow import AgentError, parse_result
from arealite.moe.trajectory import kept_routed_experts
from arealite.workflow.base import pad_and_stack


@pytest.fixture(scope="module")
def tok(micro_model_dir):
    return AutoTokenizer.from_pretrained(micro_model_dir)


# ------------------------------------------------------------------ tool calls


def test_hermes_parser_reads_calls_and_keeps_the_rest_as_content():
    p = HermesToolParser()
    turn = p.parse('Let me compute. <tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>'
                   '<tool_call>{"name": "calc", "arguments": "{\\"x\\": 2}"}</tool_call>', {"calc"})
    assert turn.content == "Let me compute." and not turn.malformed
    assert [(c.name, json.loads(c.arguments)) for c in turn.calls] == [("calc", {"x": 1}), ("calc", {"x": 2})]
    assert turn.calls[0].id != turn.calls[1].id and turn.calls[0].id.startswith("call_")
    assert p.parse("no calls here", {"calc"}).calls == []


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "calc", "arguments": {"x": 1}</tool_call>',  # broken JSON
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not a declared tool
    '<tool_call>{"name": "calc", "arguments": [1, 2]}</tool_call>',  # arguments not an object
    'ok <tool_call>{"name": "calc", "arguments": {}}',  # unclosed
])
def test_malformed_calls_come_back_as_plain_content(text):
    turn = HermesToolParser().parse(text, {"calc"})
    assert turn.malformed and turn.calls == [] and turn.content == text


def test_parsers_are_pluggable_and_bad_names_say_what_is_allowed():
    assert isinstance(make_tool_parser("hermes"), HermesToolParser)
    assert isinstance(make_tool_parser("arealite.agent.tool_parsers:HermesToolParser"), HermesToolParser)
    with pytest.raises(ValueError, match="agent.tool_parser='nope'.*hermes"):
        make_tool_parser("nope")


# ------------------------------------------------------------------ requests


def policy(honoured=("max_tokens",), cap=16, temperature=1.0):
    base = SamplingParams(max_new_tokens=12, temperature=temperature, stop_token_ids=[1])
    return SamplingPolicy(base, list(honoured), cap, max_n=4)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("extra, status, code, param, message", [
    ({"foo": 1}, 400, None, "foo", "Unrecognized request argument supplied: foo"),
    ({"frequency_penalty": 0.5}, 400, "unsupported_parameter", "frequency_penalty", "Unsupported parameter"),
    ({"logit_bias": {"5": 10}}, 400, "unsupported_parameter", "logit_bias", "Unsupported parameter"),
    ({"response_format": {"type": "json_object"}}, 400, "unsupported_parameter", "response_format", ""),
    ({"stream_options": {"include_usage": True}}, 400, None, "stream_options", "only allowed when 'stream'"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, 400,
     "unsupported_value", "tool_choice", "Unsupported value"),
    ({"tool_choice": "auto"}, 400, None, "tool_choice", "only allowed when 'tools'"),
    ({"n": 9}, 400, None, "n", "agent.max_n=4"),
    ({"temperature": 3}, 400, "invalid_value", "temperature", "Invalid value for 'temperature'"),
    ({"messages": []}, 400, None, "messages", "non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, None, "messages[0].role", "expected one of"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, None, "messages[0].tool_call_id", "tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "unsupported_value",
     "messages[0].content", "only text parts"),
])
def test_bad_chat_requests_get_openais_errors(extra, status, code, param, message):
    with pytest.raises(RequestError) as e:
        parse_request("chat", {**CHAT, **extra}, policy(), [])
    err = e.value.body()["error"]
    assert (e.value.status, err["code"], err["param"]) == (status, code, param)
    assert message in err["message"] and err["type"] == "invalid_request_error"


def test_neutral_values_of_unsupported_parameters_and_harmless_ones_are_accepted():
    req = parse_request("chat", {**CHAT, "frequency_penalty": 0, "logit_bias": {}, "seed": 3, "user": "u",
                                 "parallel_tool_calls": True, "response_format": {"type": "text"}}, policy(), [7])
    assert req.sampling.stop_token_ids == [1, 7]  # the config's stops, then the template's end of turn


def test_sampling_is_the_configs_except_what_requests_may_set():
    req = parse_request("chat", {**CHAT, "temperature": 0.3, "top_p": 0.5, "max_tokens": 8}, policy(), [])
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.max_new_tokens) == (1.0, 1.0, 8)
    assert req.overridden == 2 and not req.clamped
    req = parse_request("chat", {**CHAT, "max_completion_tokens": 100}, policy(), [])
    assert req.sampling.max_new_tokens == 16 and req.clamped  # clamped to the cap
    req = parse_request("chat", {**CHAT, "temperature": 0}, policy(honoured=("temperature",)), [])
    assert req.sampling.greedy and req.sampling.max_new_tokens == 12  # no max_tokens: the config's
    req = parse_request("chat", {**CHAT, "temperature": 1.0}, policy(), [])
    assert req.overridden == 0  # equal to the config's value: nothing overridden


def test_completion_requests():
    req = parse_request("completion", {"model": "m", "prompt": ["abc"], "logprobs": 0}, policy(), [])
    assert req.prompt == "abc" and req.logprobs
    assert parse_request("completion", {"model": "m", "prompt": [5, 6]}, policy(), []).prompt == [5, 6]
    two = parse_request("completion", {"model": "m", "prompt": "a", "logprobs": 2}, policy(), [])
    assert two.logprobs and two.top_logprobs == 2  # the legacy API's alternatives per token
    with pytest.raises(RequestError, match="logprobs"):
        parse_request("completion", {"model": "m", "prompt": "a", "logprobs": 6}, policy(), [])
    with pytest.raises(RequestError, match="echo"):
        parse_request("completion", {"model": "m", "prompt": "a", "echo": True}, policy(), [])
    with pytest.raises(RequestError, match="Unrecognized request argument supplied: messages"):
        parse_request("completion", {**CHAT}, policy(), [])


# ------------------------------------------------------------------ rendering


def test_continuation_is_exactly_the_new_turns_after_the_sampled_reply(tok):
    r = ChatRenderer(tok)
    assert r.end_of_turn == tok.convert_tokens_to_ids("<|im_end|>")
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    first = normalize_messages([{"role": "system", "content": "s"}, {"role": "user", "content": "2*3?"}])
    prompt = r.prompt_ids(first, tools)
    # the model "sampled" a tool call and the end-of-turn token
    reply = '<tool_call>{"name": "calc", "arguments": {"e": "2*3"}}</tool_call>'
    sampled = r.encode(reply) + [r.end_of_turn]
    convo = normalize_messages([*first, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "calc", "arguments": '{"e": "2*3"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "6"}])
    piece = r.continuation_ids(convo, tools, None, 2, sampled)
    # here the template renders the reply as the model wrote it: the full rendering agrees
    assert prompt + sampled + piece == r.prompt_ids(convo, tools)
    # a reply the template would render differently keeps the sampled tokens anyway
    odd = r.encode("<tool_call> {\"name\":\"calc\",\"arguments\":{\"e\":\"2*3\"}} </tool_call>")
    piece2 = r.continuation_ids(convo, tools, None, 2, odd)
    assert piece2[0] == r.end_of_turn and piece2[1:] == piece  # the turn is closed for it


def test_renderer_needs_a_chat_template(tok):
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="chat template"):
        ChatRenderer(NoTemplate())


# ------------------------------------------------------------------ sessions and rows


def call(i, prompt, out, parent=None, reward=None, finish="stop"):
    return LLMCall(f"r{i}", i, prompt, out, [-0.5] * len(out), [3] * len(out), finish, parent, reward=reward)


def test_sessions_are_found_by_key_or_url_and_never_mixed():
    store = SessionStore()
    a, b = store.open(None, "g", 4), store.open(None, "g", 4)
    assert store.find(None, a.key) is a and store.find(b.id, None) is b
    assert store.find(a.id, b.key) is None  # another episode's key in this URL
    assert store.find(None, "sk-guess") is None and store.find("sess-x", None) is None
    store.close(a)
    assert store.find(None, a.key) is None and store.find(b.id, b.key) is b


def branched_calls():
    c0 = call(0, [1, 2], [3, 4])
    c1 = call(1, [1, 2, 3, 4, 5], [6], parent=0)  # continues c0 with user turn [5]
    c2 = call(2, [1, 2, 3, 4, 7, 8], [9, 10], parent=0, reward=0.5)  # a second branch from c0
    c3 = call(3, [20], [21], finish="length")  # a fresh conversation
    return [c0, c1, c2, c3]


def test_conversation_rows_train_each_reply_once():
    rows = episode_rows(branched_calls(), "conversation")
    assert [(first, path[-1].index) for _, first, path in rows] == [(0, 1), (2, 2), (3, 3)]
    r0, r1, r2 = (r for r, _, _ in rows)
    assert r0["input_ids"].tolist() == [1, 2, 3, 4, 5, 6]
    assert r0["loss_mask"].tolist() == [False, False, True, True, False, True]
    assert r1["input_ids"].tolist() == [1, 2, 3, 4, 7, 8, 9, 10]
    assert r1["loss_mask"].tolist() == [False] * 6 + [True, True]  # c0 already trained in row 0
    assert (r0["versions"][r0["loss_mask"]] == 3).all() and (r0["versions"][~r0["loss_mask"]] == -1).all()
    assert r2["loss_mask"].tolist() == [False, True]


def test_call_rows_and_discounted_returns():
    calls = branched_calls()
    rows = episode_rows(calls, "call")
    assert [r["input_ids"].tolist() for r, _, _ in rows][1] == [1, 2, 3, 4, 5, 6]
    assert [r["loss_mask"].sum().item() for r, _, _ in rows] == [2, 1, 2, 1]
    g = call_returns(calls, reward=1.0, gamma=0.5)
    # c2 ends a conversation (1.0) and has its own 0.5; c0's last continuation is c2
    assert g == {3: 1.0, 2: 1.5, 1: 1.0, 0: 0.75}


def with_routing(calls):
    """Give call i the routing ``100 * (i + 1) + j`` for each token j it ran forward (2 ids per token)."""
    for c in calls:
        ran = len(c.prompt_ids) + len(c.output_ids) - 1
        c.routed_experts = (100 * (c.index + 1) + torch.arange(ran, dtype=torch.int32)).repeat_interleave(2).view(ran, 2)
    return calls


@pytest.mark.parametrize("mode", ["conversation", "call"])
def test_rows_take_each_tokens_routing_from_the_first_call_that_ran_it(mode):
    rows = episode_rows(with_routing(branched_calls()), mode)
    routing = with_routed_experts(pad_and_stack([r for r, _, _ in rows]), [p for _, _, p in rows])["routed_experts"]
    assert routing.shape == (len(rows), 8, 2) and routing.dtype == torch.int16
    ids = {r["input_ids"][-1].item(): k for k, (r, _, _) in enumerate(rows)}  # a row by its last token
    # c0 + user turn [5] + c1: c0 ran tokens 0..2; c1's prefill ran the user turn and c0's last token
    assert routing[ids[6], :, 0].tolist() == [-1, 100, 101, 102, 203, 204, -1, -1]
    # the branch c0 -> c2 keeps c0's routing for the shared tokens
    assert routing[ids[10], :, 0].tolist() == [-1, 100, 101, 102, 303, 304, 305, 306]
    assert routing[ids[21], :, 0].tolist() == [-1, 400] + [-1] * 6
    if mode == "call":
        assert routing[ids[4], :, 0].tolist() == [-1, 100, 101, 102] + [-1] * 4
    assert (routing[..., 0] == routing[..., 1]).all()
    calls = with_routing(branched_calls())
    calls[1].routed_experts = None  # a call the server was not asked for routing: no key
    rows = episode_rows(calls, mode)
    assert "routed_experts" not in with_routed_experts(pad_and_stack([r for r, _, _ in rows]),
                                                       [p for _, _, p in rows]).keys()


def test_a_reply_cut_at_a_stop_string_keeps_the_routing_of_the_tokens_it_keeps():
    rows = torch.arange(5 * 4, dtype=torch.int32).view(5, 4)
    comp = Completion("r", [5, 6, 7], [8, 9, 10], [0.0] * 3, [0] * 3, "stop", routed_experts=rows)
    assert torch.equal(kept_routed_experts(comp, 3), rows) and torch.equal(kept_routed_experts(comp, 1), rows[:3])
    comp.routed_experts = rows[:4]
    with pytest.raises(ValueError, match=r"completion r: routed_experts has shape \(4, 4\), expected \[5,"):
        kept_routed_experts(comp, 1)
    comp.routed_experts = None
    assert kept_routed_experts(comp, 1) is None


def test_a_broken_chain_is_an_error_not_a_silent_misalignment():
    calls = [call(0, [1], [2]), call(1, [1, 9, 3], [4], parent=0)]
    with pytest.raises(ValueError, match="does not continue call 0"):
        episode_rows(calls, "conversation")


@pytest.mark.parametrize("out, expected", [
    (1, (1.0, {})), (True, (1.0, {})), ({"reward": 0.5}, (0.5, {})),
    ({"call_rewards": {"r1": 2}}, (0.0, {"r1": 2.0})),
])
def test_agent_results(out, expected):
    assert parse_result(out) == expected


@pytest.mark.parametrize("out", [None, "1", {"score": 1}, {"reward": "high"}, float("nan"), {"call_rewards": {"a": None}}])
def test_bad_agent_results_say_what_to_return(out):
    with pytest.raises(AgentError, match="return|reward"):
        parse_result(out)


# ------------------------------------------------------------------ config


def test_agent_config_checks_name_the_field():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="cpu_s=30.0 exceeds wall_s=20.0"):
        SandboxConfig(cpu_s=30)
    with pytest.raises(ValidationError, match="capturing group"):
        JudgeConfig(score_pattern=r"\d+")
    with pytest.raises(ValidationError, match="answer"):
        JudgeConfig(rubric="grade it")
    with pytest.raises(ValidationError, match="request_sampling"):
        AgentConfig(request_sampling=["frequency_penalty"])
    assert torch.tensor(0).item() == 0
