"""verifiers environments defined by a user, offline (no hub): a SingleTurnEnv and a ToolEnv,
each a `module:function` that `rollout.workflow_kwargs.env` names. Rewards give partial credit
for the reply's length so that a tiny random model gets rewards that vary."""

import math

import verifiers as vf
from datasets import Dataset


def _questions(n: int, offset: int = 0) -> Dataset:
    return Dataset.from_list([{"question": f"What is {i % 7} + {i % 5}?", "answer": str(i % 7 + i % 5)}
                              for i in range(offset, offset + n)])


def _text(completion) -> str:
    return (completion[-1].get("content") or "") if isinstance(completion, list) and completion else str(completion)


def correct(completion, answer, **kwargs) -> float:
    """1 for the right number anywhere in the last reply, else a little for a short reply."""
    text = _text(completion)
    return 1.0 if answer in text else 0.1 / (1 + len(text))


class BrokenOnOdd(vf.SingleTurnEnv):
    """Its rollout raises on items whose answer is odd (a rubric that raises is scored 0 by verifiers itself)."""

    async def rollout(self, input, client, model, sampling_args=None):
        if int(input["answer"]) % 2 == 1:
            raise RuntimeError("the environment broke")
        return await super().rollout(input, client, model, sampling_args)


def single_turn(n: int = 32, n_eval: int = 4, fail: str = "") -> vf.Environment:
    """A SingleTurnEnv; `fail`: `raise` / `hang` / `nan` makes it misbehave on items whose answer is odd."""
    import asyncio

    async def scored(completion, answer, info=None, **kwargs) -> float:
        odd = int(answer) % 2 == 1
        if fail == "hang" and odd:
            await asyncio.sleep(3600)
        if fail == "nan" and odd:
            return math.nan
        return correct(completion, answer)

    cls = BrokenOnOdd if fail == "raise" else vf.SingleTurnEnv
    return cls(dataset=_questions(n), eval_dataset=_questions(n_eval, 1000), rubric=vf.Rubric(funcs=[scored]))


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def tool_env(n: int = 32) -> vf.Environment:
    """A ToolEnv with an `add` tool, at most 3 turns."""
    return vf.ToolEnv(dataset=_questions(n), tools=[add], rubric=vf.Rubric(funcs=[correct]), max_turns=3)
