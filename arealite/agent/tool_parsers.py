"""Tool-call parsers: the model's text -> OpenAI ``tool_calls``.

A parser turns one completion's text into ``ParsedTurn(content, calls, malformed)``.
``hermes`` (the default) reads the Hermes/Qwen format the chat templates of Qwen2.5,
Qwen3 and Hermes models teach::

    some text <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>

A call that does not parse (broken JSON, no ``name``, arguments that are not an object,
a function the request did not declare, an unclosed tag) makes the whole turn plain
content: the agent sees what the model wrote, and the endpoint counts it
(``tool_calls_malformed``) so that a training run shows how often it happens.

Parsers are pluggable: ``agent.tool_parser`` names a built-in (`PARSERS`) or
``module:Class`` of your own with the same ``parse(text, tool_names)`` method.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from arealite.utils.imports import import_callable, is_import_spec
from arealite.utils.json_types import JsonObject

__all__ = ["HermesToolParser", "ParsedTurn", "ToolCall", "ToolParser", "PARSERS", "make_tool_parser"]


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON string (as OpenAI sends them)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self) -> JsonObject:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedTurn:
    """An assistant turn split into plain content and tool calls."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    malformed: bool = False  # the text held a call that did not parse; it is all content


class ToolParser(Protocol):
    """What the endpoint asks of a tool-call parser."""

    def parse(self, text: str, tool_names: set[str] | None) -> ParsedTurn:
        """Split ``text``; ``tool_names``: the functions the request declared (None: any)."""
        ...


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, any number of them."""

    start = "<tool_call>"
    end = "</tool_call>"

    def __init__(self) -> None:
        self._block = re.compile(re.escape(self.start) + r"(.*?)" + re.escape(self.end), re.DOTALL)

    def parse(self, text: str, tool_names: set[str] | None) -> ParsedTurn:
        if self.start not in text:
            return ParsedTurn(text)
        calls: list[ToolCall] = []
        for body in self._block.findall(text):
            call = self._one(body, tool_names)
            if call is None:
                return ParsedTurn(text, malformed=True)
            calls.append(call)
        rest = self._block.sub("", text)
        if self.start in rest or not calls:  # an unclosed tag
            return ParsedTurn(text, malformed=True)
        return ParsedTurn(rest.strip(), calls)

    @staticmethod
    def _one(body: str, tool_names: set[str] | None) -> ToolCall | None:
        try:
            obj = json.loads(body.strip())
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        if tool_names is not None and obj["name"] not in tool_names:
            return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


#: Built-in parsers by the name ``agent.tool_parser`` takes.
PARSERS: dict[str, type] = {"hermes": HermesToolParser, "qwen": HermesToolParser}


def make_tool_parser(spec: str) -> ToolParser:
    """The parser ``spec`` names: a built-in (`PARSERS`) or ``module:Class``; ValueError otherwise."""
    if spec in PARSERS:
        return PARSERS[spec]()
    if not is_import_spec(spec):
        raise ValueError(f"agent.tool_parser={spec!r} is neither a built-in parser "
                         f"({', '.join(sorted(PARSERS))}) nor 'module:Class' of your own")
    try:
        cls = import_callable(spec, "agent.tool_parser")
    except (ImportError, AttributeError, TypeError) as e:
        raise ValueError(str(e)) from None
    parser = cls()
    if not callable(getattr(parser, "parse", None)):
        raise ValueError(f"agent.tool_parser={spec!r} has no parse(text, tool_names) method")
    return parser
