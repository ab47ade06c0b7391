"""Cutting the answer out of a completion, before a task scores it (`data.reasoning_gym.answer_format`)."""

from __future__ import annotations

import re

_ANSWER_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = "\\boxed{"


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces balanced (``\\boxed{\\frac{1}{2}}``)."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unclosed


def extract_answer(completion: str, answer_format: str) -> str | None:
    """The answer in ``completion`` by ``answer_format`` (`answer_tags`, `boxed`, `last_line`,
    `whole`), stripped; None when the completion holds none (the task then scores None)."""
    if answer_format == "answer_tags":
        found = _ANSWER_TAGS.findall(completion)
        answer = found[-1] if found else None
    elif answer_format == "boxed":
        answer = _last_boxed(completion)
    elif answer_format == "last_line":
        lines = [line for line in completion.splitlines() if line.strip()]
        answer = lines[-1] if lines else None
    elif answer_format == "whole":
        answer = completion
    else:
        raise ValueError(f"answer_format {answer_format!r} is not one of answer_tags, boxed, last_line, whole")
    if answer is None:
        return None
    answer = answer.strip()
    return answer or None
