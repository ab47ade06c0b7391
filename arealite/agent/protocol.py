"""The OpenAI wire format: request bodies in, responses and stream chunks out.

`parse_request` validates a ``/v1/chat/completions`` or ``/v1/completions`` body the way
OpenAI does (an unknown key: "Unrecognized request argument supplied"; a parameter we
cannot honour with a value that would change the result: ``unsupported_parameter`` /
``unsupported_value``; parameters that change nothing here, such as ``seed`` or
``user``, are accepted), and turns its sampling parameters into ``SamplingParams``
within the limits of the config (`SamplingPolicy`). `finish_choice` turns the server's
completion into a choice (stop strings applied, text decoded, tool calls parsed); the
``*_response`` and ``*_chunks`` functions shape the answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from arealite.agent.errors import RequestError, unsupported_parameter, unsupported_value
from arealite.agent.tool_parsers import ToolCall, ToolParser
from arealite.api.types import Completion, SamplingParams
from arealite.utils.json_types import JsonObject, JsonValue
from arealite.utils.tokenizer import decode

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from arealite.agent.image_parts import ImagePolicy

_COMMON = {"model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty",
           "seed", "stop", "stream", "stream_options", "temperature", "top_p", "user", "top_k", "min_p"}
CHAT_KEYS = _COMMON | {"messages", "top_logprobs", "max_completion_tokens", "response_format", "tools",
                       "tool_choice", "parallel_tool_calls", "metadata", "store", "service_tier",
                       "reasoning_effort", "modalities", "audio", "prediction", "web_search_options",
                       "functions", "function_call", "chat_template_kwargs", "safety_identifier",
                       "prompt_cache_key", "verbosity"}
COMPLETION_KEYS = _COMMON | {"prompt", "best_of", "echo", "suffix"}
# Parameters we cannot honour: refused unless they hold the value that changes nothing.
_NEUTRAL: dict[str, tuple[JsonValue, ...]] = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},),
    "modalities": (["text"],), "audio": (), "prediction": (),
    "web_search_options": (), "functions": (), "function_call": (), "best_of": (1,),
    "echo": (False,), "suffix": ("",),
    "response_format": ({"type": "text"},)}


@dataclass
class ParsedRequest:
    """A validated request."""

    kind: str  # "chat" | "completion"
    model: str
    sampling: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives reported per token (chat: top_logprobs; completions: logprobs)
    stop: list[str] = field(default_factory=list)
    messages: list[JsonObject] | None = None
    tools: list[JsonObject] | None = None
    parse_tools: bool = False
    template_kwargs: JsonObject | None = None
    prompt: str | list[int] | None = None
    overridden: int = 0  # sampling parameters the request set that the config overrode
    clamped: bool = False  # max_tokens above the config's limit

    @property
    def tool_names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools or ()}


def _number(body: JsonObject, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo < v if lo_open else lo <= v) or v > hi:
        raise RequestError(f"Invalid value for '{name}': {v!r}; expected a number in "
                           f"{'(' if lo_open else '['}{lo}, {hi}].", param=name, code="invalid_value")
    return v


def _int(body: JsonObject, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise RequestError(f"Invalid value for '{name}': {v!r}; expected an integer >= {lo}"
                           + (f" and <= {hi}" if hi is not None else "") + ".", param=name, code="invalid_value")
    return v


class SamplingPolicy:
    """Sampling of one request: the config's (`generation`), except the parameters
    `agent.request_sampling` lets a request set; ``max_tokens`` clamped to the limit."""

    def __init__(self, base: SamplingParams, honoured: list[str], max_tokens_cap: int, max_n: int):
        self.base, self.honoured, self.cap, self.max_n = base, set(honoured), max_tokens_cap, max_n
        self.default_max = min(base.max_new_tokens, max_tokens_cap)

    def __call__(self, body: JsonObject, extra_stop_ids: list[int]) -> tuple[SamplingParams, int, bool]:
        given = {"temperature": _number(body, "temperature", 0, 2), "top_p": _number(body, "top_p", 0, 1, True),
                 "top_k": _int(body, "top_k", -1), "min_p": _number(body, "min_p", 0, 1)}
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        mt = _int({"max_tokens": mt}, "max_tokens", 1)
        updates: dict[str, float | int | bool] = {"max_new_tokens": self.default_max}
        overridden, clamped = 0, False
        for name, v in given.items():
            if v is None:
                continue
            if name in self.honoured:
                updates[name] = v
            elif v != getattr(self.base, name):
                overridden += 1
        if mt is not None:
            if "max_tokens" in self.honoured:
                updates["max_new_tokens"], clamped = min(mt, self.cap), mt > self.cap
            elif mt != self.default_max:
                overridden += 1
        if updates.get("temperature") == 0:
            updates["greedy"] = True
        stop_ids = list(self.base.stop_token_ids) + [t for t in extra_stop_ids if t not in self.base.stop_token_ids]
        return self.base.replace(stop_token_ids=stop_ids, **updates), overridden, clamped


def _check_keys(body: JsonObject, allowed: set[str]) -> None:
    for key in body:
        if key not in allowed:
            raise RequestError(f"Unrecognized request argument supplied: {key}", param=key)
    for key, neutral in _NEUTRAL.items():
        v = body.get(key)
        if v is not None and key in allowed and v not in neutral:
            raise unsupported_parameter(key)


def _stop(body: JsonObject) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("'stop' must be a non-empty string or a list of at most 4 of them", param="stop")
    return stop


def _stream(body: JsonObject) -> tuple[bool, bool]:
    stream, opts = body.get("stream") or False, body.get("stream_options")
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be a boolean", param="stream")
    if opts is not None and not stream:
        raise RequestError("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                           param="stream_options")
    return stream, bool(isinstance(opts, dict) and opts.get("include_usage"))


def _tools(body: JsonObject) -> tuple[list[JsonObject] | None, bool]:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None:
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) for t in tools):
            raise RequestError("'tools' must be a list of {type: 'function', function: {name, ...}}", param="tools")
    if choice not in (None, "auto", "none"):
        raise unsupported_value("tool_choice", "may only be 'auto' or 'none' here (the model is not "
                                "constrained to call a tool)")
    if choice is not None and not tools:
        raise RequestError("'tool_choice' is only allowed when 'tools' are specified", param="tool_choice")
    return tools or None, bool(tools) and choice != "none"


def parse_request(kind: str, body: JsonValue, policy: SamplingPolicy, extra_stop_ids: list[int],
                  images: ImagePolicy | None = None) -> ParsedRequest:
    """Validate a body of ``/v1/chat/completions`` (``kind="chat"``) or ``/v1/completions``;
    ``images``: which chat ``image_url`` parts are taken (None: none)."""
    from arealite.agent.chat import normalize_messages

    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _check_keys(body, CHAT_KEYS if kind == "chat" else COMPLETION_KEYS)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("you must provide a model parameter", param="model")
    n = _int(body, "n", 1) or 1
    if n > policy.max_n:
        raise RequestError(f"Invalid value for 'n': {n}; at most agent.max_n={policy.max_n}", param="n")
    stream, include_usage = _stream(body)
    sampling, overridden, clamped = policy(body, extra_stop_ids)
    req = ParsedRequest(kind, model, sampling, n, stream, include_usage, stop=_stop(body),
                        overridden=overridden, clamped=clamped)
    if kind == "chat":
        req.logprobs = body.get("logprobs") is True
        req.top_logprobs = _int(body, "top_logprobs", 0, 20) or 0
        if req.top_logprobs and not req.logprobs:
            raise RequestError("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs",
                               code="invalid_value")
        req.messages = normalize_messages(body.get("messages"), images)
        req.tools, req.parse_tools = _tools(body)
        kw = body.get("chat_template_kwargs")
        if kw is not None and not isinstance(kw, dict):
            raise RequestError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
        req.template_kwargs = kw
    else:
        lp = _int(body, "logprobs", 0, 5)
        req.logprobs, req.top_logprobs = lp is not None, lp or 0
        req.prompt = _prompt(body.get("prompt"))
    return req


def _prompt(prompt: JsonValue) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise RequestError("'prompt' must be a non-empty string or list of token ids (one prompt per request)",
                       param="prompt")


# ------------------------------------------------------------------ answers


@dataclass
class Choice:
    """One generated choice, after stop strings and tool-call parsing."""

    index: int
    completion: Completion
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    text: str
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    malformed_tool_call: bool = False
    top: list[list[tuple[int, float]]] | None = None  # per token: (id, log-prob) of the likeliest


def _cut_at_stop(tok: PreTrainedTokenizerBase, ids: list[int], stop: list[str]) -> tuple[int, str] | None:
    """(tokens to keep, text before the stop string) when a stop string occurs, else None."""
    text = decode(tok, ids)
    hits = [(text.find(s), s) for s in stop if s in text]
    if not hits:
        return None
    pos, s = min(hits)
    lo, hi = 1, len(ids)  # the fewest tokens whose text contains the stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if s in decode(tok, ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo, text[:pos]


def finish_choice(index: int, comp: Completion, req: ParsedRequest, tok: PreTrainedTokenizerBase,
                  parser: ToolParser) -> Choice:
    """A server completion as a choice: cut at the first stop string (the tokens after it are
    dropped from the record too), decoded, tool calls parsed."""
    ids, lps, vers = list(comp.output_ids), list(comp.output_logprobs), list(comp.output_versions)
    finish = comp.finish_reason if comp.finish_reason in ("stop", "length") else "stop"
    cut = _cut_at_stop(tok, ids, req.stop) if req.stop else None
    if cut is not None:
        k, text = cut
        ids, lps, vers, finish = ids[:k], lps[:k], vers[:k], "stop"
    else:
        text = decode(tok, ids)
    choice = Choice(index, comp, ids, lps, vers, finish, text, text)
    if req.top_logprobs and comp.output_top_logprobs is not None:
        choice.top = [pos[: req.top_logprobs] for pos in comp.output_top_logprobs[: len(ids)]]
    if req.parse_tools:
        parsed = parser.parse(text, req.tool_names)
        choice.content, choice.tool_calls, choice.malformed_tool_call = parsed.content, parsed.calls, parsed.malformed
        if parsed.calls and finish == "stop":
            choice.finish_reason = "tool_calls"
    return choice


def _token_entry(tok: PreTrainedTokenizerBase, t: int, lp: float) -> JsonObject:
    s = decode(tok, [t], skip_special_tokens=False)
    return {"token": s, "logprob": lp, "bytes": list(s.encode())}


def _token_logprobs(tok: PreTrainedTokenizerBase, c: Choice) -> list[JsonObject]:
    tops = c.top if c.top is not None else [()] * len(c.output_ids)
    return [{**_token_entry(tok, t, lp), "top_logprobs": [_token_entry(tok, a, alp) for a, alp in top]}
            for t, lp, top in zip(c.output_ids, c.logprobs, tops)]


def assistant_message(c: Choice) -> JsonObject:
    """The ``message`` of a chat choice (what the agent will send back in its next request)."""
    msg: JsonObject = {"role": "assistant", "content": c.content if (c.content or not c.tool_calls) else None}
    if c.tool_calls:
        msg["tool_calls"] = [t.to_openai() for t in c.tool_calls]
    return msg


def usage(prompt_len: int, choices: list[Choice]) -> dict[str, int]:
    out = sum(len(c.output_ids) for c in choices)
    return {"prompt_tokens": prompt_len, "completion_tokens": out, "total_tokens": prompt_len + out}


def chat_response(rid: str, req: ParsedRequest, tok: PreTrainedTokenizerBase, choices: list[Choice],
                  prompt_len: int) -> JsonObject:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": req.model,
            "system_fingerprint": None,
            "choices": [{"index": c.index, "message": assistant_message(c), "finish_reason": c.finish_reason,
                         "logprobs": {"content": _token_logprobs(tok, c), "refusal": None} if req.logprobs else None}
                        for c in choices],
            "usage": usage(prompt_len, choices)}


def completion_response(rid: str, req: ParsedRequest, tok: PreTrainedTokenizerBase, choices: list[Choice],
                        prompt_len: int) -> JsonObject:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": req.model,
            "system_fingerprint": None,
            "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                         "logprobs": _legacy_logprobs(tok, c) if req.logprobs else None} for c in choices],
            "usage": usage(prompt_len, choices)}


def _legacy_logprobs(tok: PreTrainedTokenizerBase, c: Choice) -> JsonObject:
    tokens = [decode(tok, [t], skip_special_tokens=False) for t in c.output_ids]
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    top = None
    if c.top is not None:  # {token text: log-prob} per position, as the legacy API gives it
        top = [{decode(tok, [a], skip_special_tokens=False): alp for a, alp in pos} for pos in c.top]
    return {"tokens": tokens, "token_logprobs": list(c.logprobs), "top_logprobs": top, "text_offset": offsets}


def _pieces(text: str, size: int = 24) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


def chat_chunks(rid: str, req: ParsedRequest, tok: PreTrainedTokenizerBase, choices: list[Choice],
                prompt_len: int) -> Iterator[JsonObject]:
    """The stream of a chat completion: role, content pieces, tool calls, finish, usage."""
    base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": req.model,
            "system_fingerprint": None}
    if req.include_usage:
        base["usage"] = None

    def chunk(i: int, delta: JsonObject, finish: str | None = None, logprobs: JsonValue = None) -> JsonObject:
        return {**base, "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    for c in choices:
        yield chunk(c.index, {"role": "assistant", "content": ""})
        content = c.content if (c.content or not c.tool_calls) else ""
        for j, piece in enumerate(_pieces(content)):
            lp = {"content": _token_logprobs(tok, c), "refusal": None} if req.logprobs and j == 0 else None
            if piece or lp:
                yield chunk(c.index, {"content": piece}, logprobs=lp)
        for k, call in enumerate(c.tool_calls):
            yield chunk(c.index, {"tool_calls": [{"index": k, **call.to_openai()}]})
        yield chunk(c.index, {}, c.finish_reason)
    if req.include_usage:
        yield {**base, "choices": [], "usage": usage(prompt_len, choices)}


def completion_chunks(rid: str, req: ParsedRequest, tok: PreTrainedTokenizerBase, choices: list[Choice],
                      prompt_len: int) -> Iterator[JsonObject]:
    base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": req.model,
            "system_fingerprint": None}
    if req.include_usage:
        base["usage"] = None
    for c in choices:
        for j, piece in enumerate(_pieces(c.text)):
            lp = _legacy_logprobs(tok, c) if req.logprobs and j == 0 else None
            yield {**base, "choices": [{"index": c.index, "text": piece, "logprobs": lp, "finish_reason": None}]}
        yield {**base, "choices": [{"index": c.index, "text": "", "logprobs": None, "finish_reason": c.finish_reason}]}
    if req.include_usage:
        yield {**base, "choices": [], "usage": usage(prompt_len, choices)}
