"""Config of tasks that come from environment libraries: reasoning-gym's procedural tasks.

(verifiers environments and OpenEnv servers are workflows: their settings are
``rollout.workflow_kwargs``, checked against the workflow's constructor.)
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from arealite.config.section import Section

#: How the answer is cut out of a completion before the task scores it.
AnswerFormat = Literal["answer_tags", "boxed", "last_line", "whole"]

#: What a prompt adds to the question when `prompt_template` is not set, per answer format.
DEFAULT_INSTRUCTIONS: dict[str, str] = {
    "answer_tags": "\nGive your final answer between <answer> and </answer>.",
    "boxed": "\nPut your final answer in \\boxed{}.",
    "last_line": "\nGive your final answer alone on the last line.",
    "whole": "",
}


class ReasoningGymTask(Section):
    name: str = Field(min_length=1)
    """A reasoning-gym task name (`python -c "import reasoning_gym.factory as f; print(sorted(f.DATASETS))"`)."""
    weight: float = Field(1.0, gt=0)
    """Share of the items drawn from this task (weights need not sum to 1)."""
    config: dict[str, Any] = Field(default_factory=dict)
    """The task's own settings (its config dataclass: difficulty ranges, lengths, ...)."""


class ReasoningGymConfig(Section):
    task: str | None = Field(None, min_length=1)
    """One task by name; or list several in `tasks`."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Settings of `task` (ignored with `tasks`, where each has its own)."""
    tasks: list[ReasoningGymTask] = Field(default_factory=list)
    """A weighted composite of several tasks; each item is drawn from one of them."""
    size: int = Field(1000, ge=1)
    """Training items generated (procedurally, offline)."""
    eval_size: int = Field(0, ge=0)
    """Held-out items generated from another seed (0: no evaluation set)."""
    seed: int | None = None
    """Seed of the training items (None: `experiment.seed`); the held-out items use another."""
    answer_format: AnswerFormat = "answer_tags"
    """Where the answer is in a completion: `answer_tags` (the last `<answer>...</answer>`),
    `boxed` (the last `\\boxed{...}`), `last_line` (the last non-empty line), `whole`
    (the whole completion, stripped). The task's `score_answer` scores what is found."""
    prompt_template: str | None = None
    """The prompt, with `{question}` standing for the task's question (None: the question and
    an instruction that matches `answer_format`)."""

    @model_validator(mode="after")
    def _one_way_to_name_tasks(self) -> "ReasoningGymConfig":
        if (self.task is None) == (not self.tasks):
            raise ValueError("name one task (`task: <name>`, its settings in `config`) or several "
                             "(`tasks: [{name, weight, config}, ...]`), not both and not neither")
        if self.tasks and self.config:
            raise ValueError("`config` goes with `task`; with `tasks`, give each task its own `config`")
        names = [t.name for t in self.all_tasks()]
        if len(names) != len(set(names)):
            raise ValueError(f"tasks are listed twice: {names}; list each once (its weight sets its share)")
        if self.prompt_template is not None and "{question}" not in self.prompt_template:
            raise ValueError("prompt_template must contain {question} (where the task's question goes)")
        return self

    def all_tasks(self) -> list[ReasoningGymTask]:
        """The tasks items are drawn from: `tasks`, or `task` alone with weight 1."""
        if self.tasks:
            return list(self.tasks)
        return [ReasoningGymTask(name=self.task or "", config=dict(self.config))]

    def render(self, question: str) -> str:
        """The prompt of one question."""
        if self.prompt_template is not None:
            return self.prompt_template.replace("{question}", question)
        return question + DEFAULT_INSTRUCTIONS[self.answer_format]
