"""OpenAI chat messages -> token ids, rendered incrementally so that sampled tokens are never re-tokenized.

The first call of a conversation renders its messages with the model's chat template
(with the request's ``tools``). A later call that continues an earlier one (its messages
are that call's messages, then the assistant reply the endpoint returned, then new
messages) keeps the earlier call's prompt and *exactly the tokens the server sampled*, and
appends only the tokens of the new messages: the chat template renders the whole
conversation with a sentinel in place of the sampled reply, and the text after the
sentinel (the end of the assistant turn, the tool results or user turn, the opening of
the next assistant turn) is the only text tokenized. So the conversation the trainer
sees is token for token the one the policy was conditioned on, whatever the template
does to earlier turns (re-formatting tool calls, dropping reasoning).
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Sequence

from arealite.agent.errors import RequestError
from arealite.agent.image_parts import ImagePolicy, image_of_part
from arealite.utils.json_types import JsonObject, JsonValue
from arealite.vision.prompt import IMAGE_PLACEHOLDER

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["ChatRenderer", "message_key", "normalize_messages", "tools_key"]

_SENTINEL = "\u2063AREALITE_TURN\u2063"
_ROLES = ("system", "developer", "user", "assistant", "tool")


def _text(content: JsonValue, where: str, images: list | None = None, policy: ImagePolicy | None = None) -> str:
    """A message's content as one string (OpenAI allows a list of text parts). With ``policy``,
    ``image_url`` parts are taken too: each becomes ``<image>`` in the text and its image is
    appended to ``images`` (`arealite.agent.image_parts`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if policy is not None and images is not None and isinstance(part, dict) and part.get("type") == "image_url":
                images.append(image_of_part(part, f"{where}.content[{i}]", policy))
                parts.append(IMAGE_PLACEHOLDER)
                continue
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"{where}.content[{i}] is of type {kind!r}; only text parts are supported",
                                   param=f"{where}.content", code="unsupported_value")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise RequestError(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")


def _tool_calls(calls: JsonValue, where: str) -> list[JsonObject]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for i, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{where}.tool_calls[{i}] needs function.name", param=f"{where}.tool_calls")
        args = fn.get("arguments", "{}")
        args = args if isinstance(args, str) else json.dumps(args)
        out.append({"id": str(c.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def normalize_messages(messages: JsonValue, images: ImagePolicy | None = None) -> list[JsonObject]:
    """Validate OpenAI chat messages and return them in one plain form for the chat template:
    ``{role, content: str}`` (+ ``tool_calls`` on assistant turns, ``tool_call_id`` on tool turns,
    ``images`` on messages with ``image_url`` parts when ``images`` allows them).
    ``developer`` becomes ``system``. Raises `RequestError` naming the bad message."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be an object", param=where)
        role = m.get("role")
        if role not in _ROLES:
            raise RequestError(f"{where}.role is {role!r}; expected one of {', '.join(_ROLES)}", param=f"{where}.role")
        found: list = []
        msg: JsonObject = {"role": "system" if role == "developer" else role,
                           "content": _text(m.get("content"), where, found, images)}
        if found:
            msg["images"] = found
        if role == "assistant":
            calls = _tool_calls(m.get("tool_calls"), where)
            if calls:
                msg["tool_calls"] = calls
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise RequestError(f"{where} (role tool) needs a string tool_call_id", param=f"{where}.tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _canonical_args(args: str) -> str:
    try:
        return json.dumps(json.loads(args), sort_keys=True)
    except ValueError:
        return args


def message_key(msg: JsonObject) -> tuple:
    """What identifies a normalized message when a later request repeats it (tool-call ids and
    the spacing of their JSON arguments aside)."""
    calls = tuple((c["function"]["name"], _canonical_args(c["function"]["arguments"]))
                  for c in msg.get("tool_calls", ()))
    images = tuple(hashlib.sha256(b).hexdigest() if isinstance(b, bytes) else b for b in msg.get("images", ()))
    return (msg["role"], msg["content"], calls, msg.get("tool_call_id"), images)


def tools_key(tools: Sequence[JsonObject] | None, template_kwargs: JsonObject | None) -> str:
    """What else shapes the rendering: the tool schemas and extra chat-template arguments."""
    return json.dumps([tools or [], template_kwargs or {}], sort_keys=True, default=str)


class ChatRenderer:
    """Token ids of chat requests for one tokenizer (its chat template)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the OpenAI-compatible endpoint needs a tokenizer with a chat template "
                             "(tokenizer.chat_template is None)")
        self.tok = tokenizer
        self.end_of_turn = self._end_of_turn()

    def _render(self, messages: list[JsonObject], tools: list[JsonObject] | None,
                template_kwargs: JsonObject | None) -> str:
        kw = dict(template_kwargs or {})
        if tools:
            kw["tools"] = tools
        try:
            return self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
        except Exception as e:  # jinja raises its own errors (raise_exception in templates)
            raise RequestError(f"the chat template cannot render these messages: {e}", param="messages") from None

    def _end_of_turn(self) -> int | None:
        """The special token the template puts right after an assistant reply (``<|im_end|>``), if any."""
        msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL},
                {"role": "user", "content": "y"}]
        try:
            after = self._render(msgs, None, None).split(_SENTINEL, 1)[1]
        except (RequestError, IndexError):
            return None
        ids = self.tok.encode(after, add_special_tokens=False)
        special = set(getattr(self.tok, "all_special_ids", []) or [])
        special |= {i for i, t in (getattr(self.tok, "added_tokens_decoder", None) or {}).items()
                    if getattr(t, "special", False)}
        return ids[0] if ids and ids[0] in special else None

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[JsonObject], tools: list[JsonObject] | None,
                   template_kwargs: JsonObject | None = None) -> list[int]:
        """The whole conversation rendered and tokenized, ending with the assistant's turn opening."""
        return self.encode(self._render(messages, tools, template_kwargs))

    def continuation_ids(self, messages: list[JsonObject], tools: list[JsonObject] | None,
                         template_kwargs: JsonObject | None, sampled_at: int,
                         sampled_ids: Sequence[int]) -> list[int]:
        """Tokens to append after the sampled reply ``messages[sampled_at]`` (whose tokens are
        ``sampled_ids``): the end of that turn, ``messages[sampled_at + 1:]`` and the opening of
        the next assistant turn. Nothing before the reply is rendered again."""
        msgs = list(messages)
        msgs[sampled_at] = {"role": "assistant", "content": _SENTINEL}
        text = self._render(msgs, tools, template_kwargs)
        parts = text.split(_SENTINEL)
        if len(parts) != 2:
            raise RequestError("the chat template drops or repeats the assistant's reply; the endpoint "
                               "cannot continue the conversation token-exactly", param="messages")
        piece = self.encode(parts[1])
        # The server returns the stop token it ended on; the template would write it again.
        if piece and sampled_ids and piece[0] == self.end_of_turn and sampled_ids[-1] == piece[0]:
            piece = piece[1:]
        return piece
