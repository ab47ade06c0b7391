"""Verifiable reward functions: ``fn(prompt, completion, prompt_ids, completion_ids, **row) -> float``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from arealite.config.problems import ConfigProblem
from arealite.utils.imports import import_callable

if TYPE_CHECKING:
    from arealite.config.schema import ArealiteConfig


def load_reward_fn(spec: str) -> Callable[..., float]:
    """Import a reward function named ``module:function`` (e.g. ``arealite.reward.math:math_reward``);
    errors (ImportError, AttributeError, TypeError) quote `spec` and say what is wrong."""
    return import_callable(spec, "reward function")


def reward_fn_problems(cfg: ArealiteConfig) -> list[ConfigProblem]:
    """`data.reward_fn` names an importable callable (a config check, run before anything starts)."""
    try:
        load_reward_fn(cfg.data.reward_fn)
    except (ImportError, AttributeError, TypeError) as e:
        return [ConfigProblem("data.reward_fn", str(e), cfg.data.reward_fn)]
    return []


def configure(cfg: ArealiteConfig) -> None:
    """Give the library's configurable rewards the run's settings: the sandbox limits of
    `arealite.reward.code` and the judge of `arealite.reward.judge` (``cfg.agent``).
    Called where the run's workflows are built, in the process that computes rewards."""
    from arealite.reward import code, judge

    code.configure(cfg.agent.sandbox)
    judge.configure(cfg.agent.judge)
