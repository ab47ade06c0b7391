"""Verifiable reward functions: ``fn(prompt, completion, prompt_ids, completion_ids, **row) -> float``."""

from __future__ import annotations

import importlib
from typing import Callable


def load_reward_fn(spec: str) -> Callable[..., float]:
    """Import a reward function named ``module:function`` (e.g. ``arealite.reward.math:math_reward``)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TypeError(f"reward function {spec!r} must be written 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"cannot import module {module_name!r} of reward function {spec!r}: {e}") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"module {module_name!r} has no attribute {attr!r} (reward function {spec!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"reward function {spec!r} is a {type(obj).__name__}, not a callable")
    return obj
