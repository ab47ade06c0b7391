"""The OpenAI-compatible endpoint and AgentWorkflow with the real `openai` client.

Against an embedded inference server on the tiny model (a child process, real HTTP) for
the protocol and token-exactness; against a scripted model for tool calls (the tiny model
does not write them) and for agents that misbehave.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest
from transformers import AutoTokenizer

from arealite.api.types import Completion, validate_trajectory
from arealite.config.agent import AgentConfig
from arealite.config.schema import GenerationConfig, RolloutConfig
from arealite.agent.workflow import AgentError, AgentWorkflow

from conftest import RecordingClient

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "evaluate arithmetic",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


Recorder = RecordingClient  # (conftest)


@pytest.fixture
async def engine(server):
    from arealite.inference_client.sglang_client import SGLangClient

    client = SGLangClient([server.url], RolloutConfig())
    await client.initialize(timeout=60)
    try:
        yield Recorder(client)
    finally:
        await client.aclose()


class Scripted:
    """A model that answers request k with ``texts[k % len]`` + the end-of-turn token."""

    def __init__(self, tok, texts, delay=0.0):
        self.tok, self.texts, self.delay, self.calls, self.cancelled = tok, texts, delay, [], 0
        self.eot = tok.convert_tokens_to_ids("<|im_end|>")

    async def agenerate(self, req):
        k = len(self.calls)
        self.calls.append(list(req.input_ids))
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        out = self.tok.encode(self.texts[k % len(self.texts)], add_special_tokens=False) + [self.eot]
        return Completion(req.rid, list(req.input_ids), out, [-0.1] * len(out), [7] * len(out), "stop")


def workflow(tok, run, n=1, max_new_tokens=12, **kw):
    return AgentWorkflow(run, tokenizer=tok, generation=GenerationConfig(n_samples=n, max_new_tokens=max_new_tokens),
                         agent=kw.pop("agent", AgentConfig()), **kw)


# ------------------------------------------------------------------ protocol, real server


async def test_openai_client_chat_stream_and_completions(tok, engine):
    seen = {}

    async def run(client, item):
        r = await client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=6, logprobs=True, n=2)
        seen["chat"] = r
        stream = await client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, stream=True,
            stream_options={"include_usage": True})
        seen["chunks"] = [c async for c in stream]
        seen["cmpl"] = await client.completions.create(model="any", prompt="What is 1 + 1?", max_tokens=5,
                                                       logprobs=0)
        seen["models"] = await client.models.list()
        return 1.0

    wf = workflow(tok, run, rows="call")
    td = await wf.arun_episode(engine, {"prompt_id": 3})
    validate_trajectory(td)
    assert "routed_experts" not in td.keys()  # routing replay off: the servers were not asked
    calls = engine.calls
    assert len(calls) == 4 and td.batch_size[0] == 4  # 2 choices + 1 streamed + 1 completion
    r = seen["chat"]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and len(r.choices) == 2
    for ch, (inp, comp) in zip(r.choices, calls[:2]):
        assert ch.finish_reason in ("stop", "length") and ch.message.role == "assistant"
        assert [t.logprob for t in ch.logprobs.content] == pytest.approx(comp.output_logprobs)
    assert r.usage.prompt_tokens == len(calls[0][0])
    assert r.usage.completion_tokens == sum(len(c.output_ids) for _, c in calls[:2])
    chunks = seen["chunks"]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(calls[2][1].output_ids)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tok.decode(calls[2][1].output_ids, skip_special_tokens=True)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    cm = seen["cmpl"]
    assert cm.object == "text_completion" and cm.choices[0].logprobs.token_logprobs == pytest.approx(
        calls[3][1].output_logprobs)
    assert calls[3][0] == tok.encode("What is 1 + 1?", add_special_tokens=False)
    assert [m.id for m in seen["models"].data] == ["arealite-policy"]
    assert wf.stats()["agent_calls"] == 4 and wf.stats()["agent_stream_requests"] == 1


async def test_top_logprobs_come_from_the_server_through_the_openai_client(tok, engine):
    import openai

    seen = {}

    async def run(client, item):
        seen["chat"] = await client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, logprobs=True, top_logprobs=3)
        seen["cmpl"] = await client.completions.create(model="p", prompt="What is 1 + 1?", max_tokens=4, logprobs=2)
        for bad in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}):
            with pytest.raises(openai.BadRequestError, match="top_logprobs"):
                await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=2, **bad)
        return 1.0

    await workflow(tok, run, rows="call").arun_episode(engine, {"prompt_id": 0})
    content = seen["chat"].choices[0].logprobs.content
    assert len(content) == len(engine.calls[0][1].output_ids)
    for entry in content:
        alts = [a.logprob for a in entry.top_logprobs]
        assert len(alts) == 3 and alts == sorted(alts, reverse=True) and alts[-1] <= alts[0] <= 0
        assert entry.logprob <= alts[0] + 1e-6  # nothing sampled is likelier than the likeliest
        match = [a.logprob for a in entry.top_logprobs if a.token == entry.token]
        assert not match or abs(match[0] - entry.logprob) < 1e-5
    legacy = seen["cmpl"].choices[0].logprobs
    assert len(legacy.top_logprobs) == len(legacy.tokens) and all(1 <= len(d) <= 2 for d in legacy.top_logprobs)
    assert all(max(d.values()) >= lp - 1e-6 for d, lp in zip(legacy.top_logprobs, legacy.token_logprobs))


async def test_token_exact_across_five_turns_with_tool_results(tok, engine):
    async def run(client, item):
        messages = [{"role": "user", "content": "Multiply 12 by 34."}]
        for turn in range(5):
            r = await client.chat.completions.create(model="p", messages=messages, tools=TOOLS, max_tokens=8)
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": f"call{turn}", "content": f"result {turn}"})
        return 0.5

    td = await workflow(tok, run).arun_episode(engine, {"prompt_id": 0})
    validate_trajectory(td)
    assert td.batch_size[0] == 1 and len(engine.calls) == 5  # one linear conversation, one row
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    expected, mask, lps = list(engine.calls[0][0]), [False] * len(engine.calls[0][0]), []
    for turn, (inp, comp) in enumerate(engine.calls):
        # every request the server saw is exactly the conversation so far: nothing re-tokenized
        assert inp == expected
        expected += comp.output_ids
        mask += [True] * len(comp.output_ids)
        lps += comp.output_logprobs
        if turn + 1 < len(engine.calls):
            piece = engine.calls[turn + 1][0][len(expected):]
            closed = comp.output_ids[-1:] == [eot]
            assert tok.decode(piece) == ("" if closed else "<|im_end|>") + \
                f"\n<|im_start|>tool\nresult {turn}<|im_end|>\n<|im_start|>assistant\n"
            expected += piece
            mask += [False] * len(piece)
    row = td["input_ids"][0][td["attention_mask"][0]].tolist()
    assert row == expected  # the trajectory is token for token what the policy was conditioned on
    assert td["loss_mask"][0][: len(mask)].tolist() == mask
    assert td["logprobs"][0][td["loss_mask"][0]].tolist() == pytest.approx(lps)
    assert (td["versions"][0][td["loss_mask"][0]] == 0).all()
    assert td["rewards"].tolist() == [0.5] and td["n_calls"].tolist() == [5]


# ------------------------------------------------------------------ tool calls, scripted model


async def test_tool_calls_streamed_and_not_and_malformed_ones_counted(tok):
    good = 'Let me use the tool.<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
    broken = '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
    model = Scripted(tok, [good, good, broken, "408"])
    seen = {}

    async def run(client, item):
        msgs = [{"role": "user", "content": "12*34?"}]
        r = await client.chat.completions.create(model="p", messages=msgs, tools=TOOLS)
        seen["call"] = r.choices[0]
        stream = await client.chat.completions.create(model="p", messages=msgs, tools=TOOLS, stream=True)
        seen["chunks"] = [c async for c in stream]
        seen["broken"] = (await client.chat.completions.create(model="p", messages=msgs, tools=TOOLS)).choices[0]
        call = seen["call"].message.tool_calls[0]
        msgs += [seen["call"].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": str(12 * 34)}]
        seen["final"] = (await client.chat.completions.create(model="p", messages=msgs, tools=TOOLS)).choices[0]
        return 1.0

    wf = workflow(tok, run)
    td = await wf.arun_episode(model, {"prompt_id": 1})
    c = seen["call"]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me use the tool."
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "12*34"}
    deltas = [d for ch in seen["chunks"] for d in (ch.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [("calculator", {"expression": "12*34"})]
    assert seen["chunks"][-1].choices[0].finish_reason == "tool_calls"
    b = seen["broken"]
    assert b.message.tool_calls is None and b.message.content == broken and b.finish_reason == "stop"
    assert wf.stats()["agent_tool_calls_malformed"] == 1 and wf.stats()["agent_tool_calls"] == 2
    # the tools were given to the chat template, and the final call continued the first one
    assert tok.decode(model.calls[0]).startswith("<|im_start|>system\nTools: calculator<|im_end|>")
    first_out = tok.encode(good, add_special_tokens=False) + [model.eot]
    assert model.calls[3][: len(model.calls[0]) + len(first_out)] == model.calls[0] + first_out
    assert seen["final"].message.content == "408"
    assert td.batch_size[0] == 3  # call 0 -> call 3 is one conversation; calls 1 and 2 stand alone


# ------------------------------------------------------------------ bad input


async def test_bad_requests_and_unknown_sessions_get_openai_errors(tok):
    model = Scripted(tok, ["ok"])
    seen = {}

    async def run(client, item):
        ep = client.base_url
        seen["client"] = client
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}],
                                                 presence_penalty=1.0)
        seen["unsupported"] = e.value
        with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: bogus"):
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}],
                                                 extra_body={"bogus": 1})
        other = openai.AsyncOpenAI(base_url=str(ep).split("/s/")[0] + "/v1", api_key="sk-not-a-session",
                                   max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await other.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
        await other.close()
        async with aiohttp.ClientSession() as http:
            async with http.post(str(ep) + "chat/completions", data=b"{not json",
                                 headers={"Authorization": f"Bearer {client.api_key}"}) as resp:
                seen["bad_json"] = (resp.status, await resp.json())
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
        return 0.0

    wf = workflow(tok, run)
    await wf.arun_episode(model, {"prompt_id": 2})
    assert seen["unsupported"].code == "unsupported_parameter" and seen["unsupported"].param == "presence_penalty"
    status, body = seen["bad_json"]
    assert status == 400 and "parse the JSON body" in body["error"]["message"]
    # the episode is over: its key no longer opens a session
    with pytest.raises(openai.AuthenticationError, match="unknown or its episode ended"):
        await seen["client"].chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
    st = wf.stats()
    assert st["agent_unknown_session"] == 2 and st["agent_request_errors"] >= 4 and st["agent_calls"] == 1


async def test_an_agent_that_raises_or_hangs_fails_its_item_and_nothing_hangs(tok):
    async def raises(client, item):
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
        raise KeyError("the agent's own bug")

    with pytest.raises(AgentError, match="raised on item 5: KeyError"):
        await workflow(tok, raises, n=2).arun_episode(Scripted(tok, ["a"]), {"prompt_id": 5})

    async def hangs(client, item):
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
        await asyncio.Event().wait()

    slow = Scripted(tok, ["a"], delay=30.0)  # the second episode's call is still generating
    calls_ok = Scripted(tok, ["a"])

    t0 = time.monotonic()
    with pytest.raises(AgentError, match="did not return within timeout_s=1s on item 6"):
        await workflow(tok, hangs, n=3, timeout_s=1.0).arun_episode(calls_ok, {"prompt_id": 6})
    with pytest.raises(AgentError, match="timeout_s=1s"):
        await workflow(tok, hangs, n=2, timeout_s=1.0).arun_episode(slow, {"prompt_id": 6})
    assert time.monotonic() - t0 < 10
    await asyncio.sleep(0.1)
    assert slow.cancelled == 2  # the calls in flight were cancelled with their episodes

    async def returns_junk(client, item):
        return "great"

    with pytest.raises(AgentError, match="return a number"):
        await workflow(tok, returns_junk).arun_episode(calls_ok, {"prompt_id": 7})
    with pytest.raises(TypeError, match="async def run"):
        workflow(tok, lambda client, item: 1.0)


async def test_concurrent_episodes_never_mix(tok):
    model = Scripted(tok, ["fine"], delay=0.01)

    async def run(client, item):
        me = client.base_url.path.split("/")[2]  # the session id in the URL
        messages = [{"role": "user", "content": f"I am {me}"}]
        for _ in range(3):
            r = await client.chat.completions.create(model="p", messages=messages)
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": me}]
        return 1.0

    td = await workflow(tok, run, n=6).arun_episode(model, {"prompt_id": 0})
    assert td.batch_size[0] == 6 and td["n_calls"].tolist() == [3] * 6
    for row in range(6):
        text = tok.decode(td["input_ids"][row][td["attention_mask"][row]].tolist())
        me = text.split("I am ", 1)[1].split("<|im_end|>")[0]
        assert text.count("sess-") == 3 and text.count(me) == 3  # only its own session's turns


async def test_groups_started_together_share_one_endpoint_and_its_counters(tok):
    model = Scripted(tok, ["fine"], delay=0.01)

    async def run(client, item):
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "Hi"}])
        return 1.0

    wf = workflow(tok, run, n=2)
    # Eight groups ask for the endpoint at once, as the controller's first batch does.
    tds = await asyncio.gather(*(wf.arun_episode(model, {"prompt_id": i}) for i in range(8)))
    assert all(td.batch_size[0] == 2 for td in tds)
    assert wf.stats()["agent_calls"] == 16 and wf.stats()["episodes"] == 16  # none counted on a lost copy
    ep = await wf.endpoint()
    assert ep is wf._ep and ep.running


@pytest.mark.slow
def test_served_on_the_controllers_loop(server, tiny_model_dir):
    from arealite.inference_client.sglang_client import SGLangClient
    from arealite.rollout.controller import RolloutController

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    loops = set()

    async def run(client, item):
        loops.add(id(asyncio.get_running_loop()))
        r = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": item["prompt"]}])
        return float(bool(r.choices[0].message.content))

    rc = RolloutConfig(consumer_batch_size=2, max_head_offpolicyness=1)
    ctl = RolloutController(SGLangClient([server.url], rc), rc).start(init_timeout=60)
    try:
        wf = workflow(tokenizer, run, n=2, max_new_tokens=6)
        batch = ctl.rollout_batch([{"prompt": "hello", "prompt_id": i} for i in range(2)], wf)
        validate_trajectory(batch)
        assert batch.batch_size[0] == 4 and loops == {id(ctl._loop)}
        assert ctl.stats()["workflow/agent_calls"] == 4
        url = wf._ep.url
    finally:
        ctl.stop()
    with pytest.raises(OSError):  # the controller's shutdown closed the endpoint
        import urllib.request

        urllib.request.urlopen(url + "/v1/models", timeout=2)
