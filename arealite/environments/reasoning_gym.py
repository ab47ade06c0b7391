"""reasoning-gym's own score as the reward (`data.source: reasoning_gym`).

Each item carries its task's name, settings and entry (`arealite.data.reasoning_gym`);
the answer is cut out of the completion by the item's answer format
(`arealite.environments.answers`) and handed with the entry to the task's
``score_answer``. The scorers are built once per process and task settings.
"""

from __future__ import annotations

import json
import threading
from typing import Callable

from arealite.environments.answers import extract_answer
from arealite.utils.json_types import JsonObject

_SCORERS: dict[str, Callable[[str | None, JsonObject], float]] = {}
_LOCK = threading.Lock()


def task_scorer(task: str, config: JsonObject) -> Callable[[str | None, JsonObject], float]:
    """``score_answer`` of the task with these settings (reasoning-gym may score by its config)."""
    key = json.dumps([task, config], sort_keys=True, default=str)
    scorer = _SCORERS.get(key)
    if scorer is None:
        from arealite.data.reasoning_gym import task_dataset
        from arealite.config.environments import ReasoningGymTask

        with _LOCK:  # reward threads may ask at once; build each scorer once
            scorer = _SCORERS.get(key)
            if scorer is None:
                ds = task_dataset(ReasoningGymTask(name=task, config=dict(config)), seed=0, size=1)
                scorer = _SCORERS[key] = ds.score_answer
    return scorer


def reasoning_gym_reward(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int],
                         reasoning_gym: JsonObject | None = None, **fields: object) -> float:
    """The task's score of the answer in ``completion`` (0.0 when it holds none the task accepts).

    The default `data.reward_fn` of `data.source: reasoning_gym`; any item field named
    ``reasoning_gym`` (task, config, entry, answer_format) works the same way.
    """
    if not isinstance(reasoning_gym, dict) or not {"task", "entry", "answer_format"} <= set(reasoning_gym):
        raise ValueError("the item has no 'reasoning_gym' field {task, config, entry, answer_format}: this reward "
                         "scores items of data.source: reasoning_gym; set data.reward_fn for other data")
    answer = extract_answer(completion, str(reasoning_gym["answer_format"]))
    scorer = task_scorer(str(reasoning_gym["task"]), reasoning_gym.get("config") or {})
    return float(scorer(answer, reasoning_gym["entry"]))
