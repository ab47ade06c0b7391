"""Streaming a reply while it is generated (`stream: true`), as far as the inference client allows.

The run's inference client gets whole generation *segments* from the servers (one per
request, more when a weight update interrupts it and it resumes), not single tokens: it
calls ``GenerationRequest.metadata["on_segment"](ids)`` as each one arrives. The endpoint
sends the text of every segment at once, and the rest (tool calls, the finish reason,
usage, log-probs) when the completion is done, so a reply interrupted by a weight update
streams its first part before the update. A client that never calls the hook streams
everything at the end.

Only text that the final parse cannot take back is sent early: nothing from the start of a
tool-call tag (``parser.start``) or of a ``stop`` string on, no trailing whitespace when
tool calls are parsed (a reply with a call is stripped), nothing at all for a reply that
starts with whitespace while tool calls are parsed, and no incomplete UTF-8 character.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING, Iterable

from arealite.utils.json_types import JsonObject, JsonValue
from arealite.utils.tokenizer import decode

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from arealite.agent.protocol import Choice, ParsedRequest
    from arealite.agent.tool_parsers import ToolParser

__all__ = ["safe_prefix", "LiveStream"]


def _hold_from(text: str, marks: Iterable[str]) -> int:
    """The first position from which ``text`` starts one of ``marks``, or could once more comes."""
    cut = len(text)
    for m in marks:
        if not m:
            continue
        i = text.find(m)
        if i >= 0:
            cut = min(cut, i)
        for k in range(min(len(m) - 1, len(text)), 0, -1):  # a partial mark at the end
            if m.startswith(text[-k:]):
                cut = min(cut, len(text) - k)
                break
    return cut


def safe_prefix(text: str, marks: Iterable[str], strip: bool) -> str:
    """The part of ``text`` (a reply so far) that the finished reply's content will start with."""
    text = text.rstrip("\ufffd")  # a character whose bytes are not all there yet
    text = text[:_hold_from(text, marks)]
    if strip:
        if text[:1].isspace():
            return ""
        text = text.rstrip()
    return text


class LiveStream:
    """The server-sent events of one streamed request, written as the segments come."""

    def __init__(self, req: ParsedRequest, tok: PreTrainedTokenizerBase, parser: ToolParser):
        self.req, self.tok = req, tok
        start = getattr(parser, "start", None) if req.parse_tools else None
        self.live = not (req.parse_tools and not start)  # a parser without a known tag: at the end
        self.marks = [start, *req.stop] if start else list(req.stop)
        self.ids: list[list[int]] = [[] for _ in range(req.n)]
        self.sent = [""] * req.n
        self.mismatched = 0

    def hook(self, i: int):
        def on_segment(ids: list[int]) -> None:
            self.ids[i].extend(ids)
        return on_segment

    def early_chunks(self, rid: str, opened: bool) -> list[JsonObject]:
        """Chunks of the text that became safe since the last call (and the opening ones)."""
        out = []
        for i in range(self.req.n):
            if not opened and self.req.kind == "chat":
                out.append(self._chunk(rid, i, {"role": "assistant", "content": ""}))
            if not self.live or not self.ids[i]:
                continue
            text = safe_prefix(decode(self.tok, self.ids[i]), self.marks, self.req.parse_tools)
            if len(text) > len(self.sent[i]) and text.startswith(self.sent[i]):
                piece, self.sent[i] = text[len(self.sent[i]):], text
                out.append(self._chunk(rid, i, {"content": piece} if self.req.kind == "chat" else piece))
        return out

    @staticmethod
    def without_opening(chunks: Iterable[JsonObject]) -> list[JsonObject]:
        """The finished completion's chunks less the opening (role) ones, already sent."""
        return [c for c in chunks if not (c.get("choices") and "role" in c["choices"][0].get("delta", {}))]

    def rest_of(self, choices: list[Choice]) -> list[Choice]:
        """``choices`` with the text already sent taken off their content / text."""
        out = []
        for c in choices:
            sent = self.sent[c.index]
            field = "content" if self.req.kind == "chat" else "text"
            full = getattr(c, field) or ""
            if sent and not full.startswith(sent):  # should not happen; never send text twice
                self.mismatched += 1
                full = sent
            out.append(replace(c, **{field: full[len(sent):]}))
        return out

    def _chunk(self, rid: str, i: int, delta: JsonValue) -> JsonObject:
        base = {"id": rid, "model": self.req.model, "system_fingerprint": None, "created": 0}
        if self.req.include_usage:
            base["usage"] = None
        if self.req.kind == "chat":
            return {**base, "object": "chat.completion.chunk",
                    "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]}
        return {**base, "object": "text_completion",
                "choices": [{"index": i, "text": delta, "logprobs": None, "finish_reason": None}]}


def sse(obj: JsonObject | bytes) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
