"""A user's reward function, named in a config by `module:name`: partial credit that varies
from sample to sample even for a barely trained model (so every step has a gradient)."""

from __future__ import annotations


def digit_share(prompt: str, completion: str, prompt_ids=None, completion_ids=None, **_) -> float:
    """The share of the completion's non-space characters that are digits (0 when empty)."""
    chars = [c for c in completion if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0


def length_share(prompt: str, completion: str, prompt_ids=None, completion_ids=None, **_) -> float:
    """The completion's length in tokens over 8 (capped at 1): positive for any greedy answer, so a
    synchronous run with no baseline (`adv_estimator: none`) moves its weights every step."""
    return min(len(completion_ids or ()), 8) / 8
