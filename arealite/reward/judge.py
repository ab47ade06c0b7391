"""LLM-as-judge reward: a separate group of inference servers grades answers with a rubric.

The judge servers are SGLang or arealite's embedded server (the same ``/generate``
protocol as the policy's) started for the judge model, given by address
(``agent.judge.addrs``, or ``AREALITE_JUDGE_ADDRS=host:port,...`` in the environment). The rubric is rendered as a user turn with the judge
tokenizer's chat template; the score is the last match of ``score_pattern`` in the
reply, divided by ``max_score`` and clipped to [0, 1]. A reply without a score scores 0
and is counted (``Judge.counters["unparsable"]``).

As a ``data.reward_fn``: ``arealite.reward.judge:judge_reward`` (the question is the
prompt, the reference the item's ``answer``). In an agent: ``await Judge(cfg).ascore(...)``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from arealite.config.agent import JudgeConfig
from arealite.inference_client.wire import loads as strict_json  # no NaN, bounded nesting
from arealite.utils.json_types import JsonValue

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Judge", "configure", "judge_reward"]

ADDRS_ENV = "AREALITE_JUDGE_ADDRS"

_MAX_ANSWER_BYTES = 8 << 20  # a judge's answer is a few hundred tokens


class Judge:
    """Grades answers on the judge servers (blocking calls; `ascore` for an event loop)."""

    def __init__(self, config: JudgeConfig, addrs: list[str] | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None):
        self.config = config
        env = [a for a in os.environ.get(ADDRS_ENV, "").split(",") if a]
        self.addrs = [a if a.startswith("http") else "http://" + a for a in (addrs or config.addrs or env)]
        if not self.addrs:
            raise ValueError(f"no judge servers: set agent.judge.addrs (or {ADDRS_ENV}=host:port,...) to "
                             "inference servers started for the judge model")
        path = config.tokenizer_path or config.model_path
        if tokenizer is None:
            if path is None:
                raise ValueError("the judge needs a tokenizer: set agent.judge.tokenizer_path or model_path")
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path)
        self.tok = tokenizer
        self.pattern = re.compile(config.score_pattern)
        self._next = itertools.cycle(range(len(self.addrs)))
        self._lock = threading.Lock()
        self.counters = {"judged": 0, "unparsable": 0, "server_errors": 0}

    def prompt_ids(self, question: str, answer: str, reference: str = "") -> list[int]:
        text = self.config.rubric.format(question=question, answer=answer, reference=reference,
                                         max_score=self.config.max_score)
        if getattr(self.tok, "chat_template", None):
            text = self.tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=False)
        return list(self.tok.encode(text, add_special_tokens=False))

    def parse(self, reply: str) -> float | None:
        """The reward a judge's reply gives (None: no score in it)."""
        found = self.pattern.findall(reply)
        if not found:
            return None
        last = found[-1] if isinstance(found[-1], str) else found[-1][0]
        return min(1.0, max(0.0, float(last) / self.config.max_score))

    def _generate(self, ids: list[int]) -> str:
        body = json.dumps({"input_ids": ids, "rid": uuid.uuid4().hex, "sampling_params": {
            "max_new_tokens": self.config.max_new_tokens, "temperature": self.config.temperature}}).encode()
        headers = {"Content-Type": "application/json"}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        errors = []
        for _ in range(len(self.addrs)):
            with self._lock:
                addr = self.addrs[next(self._next)]
            try:
                req = urllib.request.Request(addr + "/generate", data=body, headers=headers)
                with urllib.request.urlopen(req, timeout=self.config.timeout_s) as r:
                    raw = r.read(_MAX_ANSWER_BYTES + 1)
                if len(raw) > _MAX_ANSWER_BYTES:
                    raise ValueError(f"answer larger than {_MAX_ANSWER_BYTES} bytes")
                data = strict_json(raw)
                data = data[0] if isinstance(data, list) else data
                out = data.get("output_ids") or [e[1] for e in data["meta_info"]["output_token_logprobs"]]
                return self.tok.decode(out, skip_special_tokens=True)
            except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError, IndexError,
                    OverflowError, AttributeError) as e:  # a broken or hostile answer: the next server
                self.counters["server_errors"] += 1
                errors.append(f"{addr}: {e}")
        raise RuntimeError("every judge server failed: " + " | ".join(errors))

    def score(self, question: str, answer: str, reference: str = "") -> float:
        """The judge's reward for ``answer`` in [0, 1] (0 when its reply has no score)."""
        reply = self._generate(self.prompt_ids(question, answer, reference))
        self.counters["judged"] += 1
        value = self.parse(reply)
        if value is None:
            self.counters["unparsable"] += 1
            return 0.0
        return value

    async def ascore(self, question: str, answer: str, reference: str = "") -> float:
        return await asyncio.to_thread(self.score, question, answer, reference)


_CONFIG = JudgeConfig()
_DEFAULT: Judge | None = None
_DEFAULT_LOCK = threading.Lock()


def configure(config: JudgeConfig) -> None:
    """Set the judge `judge_reward` uses (the run's ``agent.judge``); built on first use."""
    global _CONFIG, _DEFAULT
    with _DEFAULT_LOCK:
        _CONFIG, _DEFAULT = config, None


def judge_reward(prompt: str, completion: str, prompt_ids: Sequence[int] | None = None,
                 completion_ids: Sequence[int] | None = None, *, answer: JsonValue = "", **_: JsonValue) -> float:
    """A ``data.reward_fn``: the configured judge's grade of ``completion`` for ``prompt``."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = Judge(_CONFIG)
        judge = _DEFAULT
    return judge.score(prompt, completion, "" if answer is None else str(answer))
