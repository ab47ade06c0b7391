"""The run's prompt sets, from where `data.source` says: files, reasoning-gym's generators, or
the workflow's environment (whose datasets the caller supplies: data imports no workflow)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from arealite.data.dataset import DatasetRows, load_items
from arealite.utils.json_types import JsonObject

if TYPE_CHECKING:
    from arealite.config.schema import ArealiteConfig

#: ``sets(cfg) -> (training items, held-out items)`` of the workflow's environment.
EnvironmentSets = Callable[["ArealiteConfig"], "tuple[Sequence[JsonObject], Sequence[JsonObject]]"]


def load_prompt_sets(cfg: ArealiteConfig, environment: EnvironmentSets | None = None
                     ) -> tuple[Sequence[JsonObject], Sequence[JsonObject]]:
    """Training and held-out items (held-out cut to `evaluation.max_prompts`), not yet
    checked against the tokenizer (`arealite.data.validate`). ``environment``: how to get the
    datasets of `data.source: environment` (`arealite.workflow.registry.environment_prompt_sets`)."""
    d = cfg.data
    if d.source == "reasoning_gym":
        from arealite.data.reasoning_gym import reasoning_gym_items

        train, held_out = reasoning_gym_items(d.reasoning_gym, cfg.experiment.seed, d.prompt_key)
    elif d.source == "environment":
        if environment is None:
            raise ValueError("data.source is environment: pass the workflow's datasets (environment=...)")
        train, held_out = environment(cfg)
    else:
        train = load_items(d.train_path, d.prompt_key, d.answer_key, image_key=d.image_key)
        held_out = (load_items(d.eval_path, d.prompt_key, d.answer_key, image_key=d.image_key)
                    if d.eval_path else DatasetRows())
    return train, held_out[: cfg.evaluation.max_prompts or len(held_out)]
