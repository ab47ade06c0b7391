"""Streaming replies as they are generated, with the real `openai` client and `tools=` set.

The inference client hands the endpoint each generated segment (`metadata["on_segment"]`);
the endpoint sends the text that the final parse cannot take back at once, the rest (tool
calls, finish reason, usage) at the end."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from arealite.agent.streaming import safe_prefix
from arealite.api.types import Completion
from arealite.config.agent import AgentConfig
from arealite.config.schema import GenerationConfig, RolloutConfig
from arealite.agent.workflow import AgentWorkflow

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "evaluate arithmetic",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_safe_prefix_holds_back_what_the_final_parse_could_take_back():
    marks = ["<tool_call>", "STOP"]
    assert safe_prefix("Let me use the tool.", marks, strip=True) == "Let me use the tool."
    assert safe_prefix("Let me use the tool. <tool", marks, strip=True) == "Let me use the tool."
    assert safe_prefix("Let me <tool_call>{...", marks, strip=True) == "Let me"
    assert safe_prefix("abc ST", marks, strip=False) == "abc "  # may become a stop string
    assert safe_prefix("abc STOP and more", marks, strip=False) == "abc "
    assert safe_prefix(" leading space", marks, strip=True) == ""  # a call would strip it
    assert safe_prefix("caf\ufffd", [], strip=False) == "caf"  # an incomplete character


class TwoSegments:
    """A model whose reply comes in two segments (as after a weight update's interruption):
    the first at once, the second only when the test releases it."""

    def __init__(self, tok, first: str, second: str):
        self.tok, self.first, self.second = tok, first, second
        self.release, self.calls = asyncio.Event(), 0
        self.eot = tok.convert_tokens_to_ids("<|im_end|>")

    async def agenerate(self, req):
        self.calls += 1
        a = self.tok.encode(self.first, add_special_tokens=False)
        b = self.tok.encode(self.second, add_special_tokens=False) + [self.eot]
        hook = req.metadata.get("on_segment")
        if hook is not None:
            hook(a)
            await self.release.wait()
            hook(b)
        return Completion(req.rid, list(req.input_ids), a + b, [-0.1] * (len(a) + len(b)), [3] * (len(a) + len(b)),
                          "stop")


async def test_text_streams_before_the_completion_is_done_and_tool_calls_at_the_end(tok):
    model = TwoSegments(tok, "Let me use the tool.", " " + CALL)
    seen: dict = {"early": []}

    async def run(client, item):
        stream = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "12*34?"}],
                                                      tools=TOOLS, stream=True, stream_options={"include_usage": True})
        chunks = []
        async for c in stream:
            chunks.append(c)
            if not model.release.is_set() and c.choices and c.choices[0].delta.content:
                seen["early"].append(c.choices[0].delta.content)  # arrived while generation is held
                model.release.set()
        seen["chunks"] = chunks
        return 1.0

    wf = AgentWorkflow(run, tokenizer=tok, generation=GenerationConfig(n_samples=1, max_new_tokens=64),
                       agent=AgentConfig())
    td = await asyncio.wait_for(wf.arun_episode(model, {"prompt_id": 1}), 30)
    assert seen["early"] == ["Let me use the tool."]  # none of the tool-call text went early
    chunks = seen["chunks"]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Let me use the tool."
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [("calculator", {"expression": "12*34"})]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == int(td["attention_mask"].sum()) - chunks[-1].usage.prompt_tokens
    assert wf.stats()["agent_stream_mismatched"] == 0


async def test_generation_error_after_the_stream_started_ends_it_with_an_error_event(tok):
    import openai

    class FailsMidway(TwoSegments):
        async def agenerate(self, req):
            req.metadata["on_segment"](self.tok.encode("partial", add_special_tokens=False))
            await asyncio.sleep(0.05)
            from arealite.inference_client.errors import GenerationError
            raise GenerationError("server went away")

    model = FailsMidway(tok, "", "")
    seen = {}

    async def run(client, item):
        stream = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}],
                                                      tools=TOOLS, stream=True)
        got = []
        with pytest.raises(openai.APIError, match="server went away"):
            async for c in stream:
                got.append(c.choices[0].delta.content if c.choices else None)
        seen["got"] = got
        return 0.0

    wf = AgentWorkflow(run, tokenizer=tok, generation=GenerationConfig(n_samples=1, max_new_tokens=16),
                       agent=AgentConfig())
    await asyncio.wait_for(wf.arun_episode(model, {"prompt_id": 1}), 30)
    assert seen["got"] == ["", "partial"]


async def test_real_server_stream_with_tools_matches_the_recorded_call(tok, tiny_server):
    """The real remote client and embedded server: the streamed reply, with tools offered, is the
    reply the session recorded (and the hook was fed by the inference client)."""
    from arealite.inference_client.sglang_client import SGLangClient

    client = SGLangClient([tiny_server.url], RolloutConfig())
    await client.initialize(timeout=60)
    segments = []

    class Spy:
        async def agenerate(self, req):
            hook = req.metadata["on_segment"]
            req.metadata["on_segment"] = lambda ids: (segments.append(list(ids)), hook(ids))
            return await client.agenerate(req)

    seen = {}

    async def run(c, item):
        stream = await c.chat.completions.create(model="p", messages=[{"role": "user", "content": "What is 2+2?"}],
                                                 tools=TOOLS, max_tokens=12, stream=True)
        seen.setdefault("chunks", []).append([x async for x in stream])
        return 1.0

    try:
        wf = AgentWorkflow(run, tokenizer=tok, generation=GenerationConfig(n_samples=2, max_new_tokens=12),
                           agent=AgentConfig())
        td = await asyncio.wait_for(wf.arun_episode(Spy(), {"prompt_id": 1}), 60)
    finally:
        await client.aclose()
    assert len(segments) == 2 and all(segments)  # one segment per episode, fed by the real client
    out = td["input_ids"][0][td["loss_mask"][0].bool()].tolist()
    assert out in segments
    from arealite.agent.tool_parsers import make_tool_parser
    from arealite.utils.tokenizer import decode

    parser = make_tool_parser("hermes")
    expected = sorted(parser.parse(decode(tok, seg), {"calculator"}).content for seg in segments)
    got = sorted("".join(x.choices[0].delta.content or "" for x in chunks if x.choices) for chunks in seen["chunks"])
    assert got == expected  # what streamed is the parsed reply, token for token what was generated
    assert wf.stats()["agent_stream_mismatched"] == 0
