"""Sessions: one per episode, holding every LLM call the episode's agent made.

A session is what keeps concurrent episodes apart: each has a secret key (the API key its
client sends) and an id (usable in the URL, ``/s/<id>/v1``); a request carrying neither a
known key nor a known id is refused. The session records each call (`LLMCall`: the exact
prompt tokens, the sampled tokens with their log-probs and policy versions, the MoE routing
when the server reports it) and links it
to the call it continues (``parent``), so that the workflow can rebuild the episode's
conversations token-exactly.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

from arealite.api.contracts import InferenceClient
from arealite.vision.prompt import VisionPrompt

if TYPE_CHECKING:
    import torch

__all__ = ["CallKey", "LLMCall", "Session", "SessionStore"]

#: How a later request recognises a call: ``(tools key, message keys incl. the reply)`` for chat,
#: the prompt text + returned text for completions; None for a prompt of token ids.
CallKey = Union[tuple[str, list[tuple]], str, None]


@dataclass
class LLMCall:
    """One choice of one request, as the policy produced it."""

    id: str  # the response id the agent saw ("chatcmpl-..."/"cmpl-..."); choices of one response share it
    index: int  # order of the call within its session
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    parent: int | None = None  # the call whose prompt + output this call's prompt starts with
    key: CallKey = None  # how a later request recognises this call (`CallKey`)
    reward: float | None = None
    tool_calls: int = 0
    vision: VisionPrompt | None = None  # the images of a vision-language prompt (its first render)
    #: The MoE routing the server reported (routing replay, `arealite.moe.trajectory`): int32
    #: ``[len(prompt_ids) + len(output_ids) - 1, n_moe_layers * top_k]``; None: not asked.
    routed_experts: torch.Tensor | None = None


@dataclass
class Session:
    """The calls of one episode, and what its requests need (the client, the affinity key)."""

    id: str
    key: str
    client: InferenceClient
    affinity_key: str
    max_calls: int
    calls: list[LLMCall] = field(default_factory=list)
    tasks: set[asyncio.Task] = field(default_factory=set)
    closed: bool = False

    def chat_parent(self, tools_key: str, message_keys: list[tuple]) -> tuple[LLMCall, int] | None:
        """The latest chat call this conversation continues, and the index of that call's reply
        in ``message_keys`` (None: a new conversation, rendered from the start)."""
        for call in reversed(self.calls):
            if not isinstance(call.key, tuple) or call.key[0] != tools_key:
                continue
            keys = call.key[1]
            if len(message_keys) > len(keys) and message_keys[: len(keys)] == keys:
                return call, len(keys) - 1
        return None

    def text_parent(self, prompt: str) -> tuple[LLMCall, str] | None:
        """The latest completion call whose prompt + returned text ``prompt`` extends, and the rest."""
        for call in reversed(self.calls):
            if isinstance(call.key, str) and len(prompt) > len(call.key) and prompt.startswith(call.key):
                return call, prompt[len(call.key):]
        return None

    def record(self, call: LLMCall) -> LLMCall:
        call.index = len(self.calls)
        self.calls.append(call)
        return call


class SessionStore:
    """Open sessions by id and by key."""

    def __init__(self) -> None:
        self._by_id: dict[str, Session] = {}
        self._by_key: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def open(self, client: InferenceClient, affinity_key: str, max_calls: int) -> Session:
        s = Session("sess-" + secrets.token_hex(8), "sk-arealite-" + secrets.token_hex(16), client,
                    affinity_key, max_calls)
        self._by_id[s.id] = s
        self._by_key[s.key] = s
        return s

    def find(self, session_id: str | None, api_key: str | None) -> Session | None:
        """The session a request belongs to: by the id in its URL, else by its key. When both
        are given they must name the same session (a key from another episode is refused)."""
        if session_id is not None:
            s = self._by_id.get(session_id)
            if s is not None and api_key is not None and api_key in self._by_key and self._by_key[api_key] is not s:
                return None
            return s
        return self._by_key.get(api_key) if api_key is not None else None

    def close(self, s: Session) -> None:
        """End a session: later requests with its key are refused; calls still running are cancelled."""
        s.closed = True
        self._by_id.pop(s.id, None)
        self._by_key.pop(s.key, None)
        for t in list(s.tasks):
            t.cancel()
