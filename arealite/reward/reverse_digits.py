"""The CPU demo's task: reverse a string of digits.

A prompt reads ``reverse 4813 =`` and the right completion is `` 3184``
followed by the end-of-text token. The reward is 1.0 for the exact reversed
digits and 0.0 otherwise: verifiable, cheap, and learnable by a ~1M-parameter
model within minutes on a CPU.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

from arealite.utils.json_types import JsonObject, JsonValue


def make_prompt(digits: str) -> str:
    return f"reverse {digits} ="


def make_items(n: int, seed: int, min_len: int = 3, max_len: int = 5,
               exclude: set[str] | None = None) -> list[JsonObject]:
    """``n`` distinct, non-palindromic digit strings as dataset rows
    ``{"prompt_id", "prompt", "answer", "digits"}``."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    items: list[JsonObject] = []
    while len(items) < n:
        s = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_len, max_len)))
        if s == s[::-1] or s in seen:
            continue
        seen.add(s)
        items.append({"prompt_id": len(items), "prompt": make_prompt(s), "answer": s[::-1], "digits": s})
    return items


def write_jsonl(items: list[JsonObject], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(it) + "\n" for it in items))
    return p


def reverse_digits_reward(prompt: str, completion: str, prompt_ids: Sequence[int] | None = None,
                          completion_ids: Sequence[int] | None = None, answer: JsonValue = None,
                          **_: JsonValue) -> float:
    """1.0 if the completion (whitespace stripped) is exactly ``answer``, else 0.0."""
    if answer is None:
        raise ValueError("reverse_digits_reward needs the item's 'answer' field")
    return 1.0 if completion.strip() == str(answer) else 0.0
