"""The tool-use demo's agent: multiply two 4-digit numbers, with a calculator if it likes.

Written against the OpenAI API only (no arealite import): the model is offered a
`calculator` tool; when it calls it, the agent evaluates the expression and sends the
result back as a `tool` message, and the model answers. The reward is 1.0 when the last
number of the final answer is the product. The tiny model cannot multiply in its head, so
the reward is in practice the reward of using the tool and copying its result right.

    rollout:
      workflow: agent
      workflow_kwargs: {run: tool_use.agent:run}     # with examples/ on PYTHONPATH
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from typing import Any

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of integers (+, -, *, //, %, parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}]
MAX_TURNS = 3  # model calls per episode: a tool call, its answer, one spare

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def calculate(expression: str) -> str:
    """The calculator tool: the value of an integer expression, or ``error: ...``."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if max(abs(left), abs(right)) > 10**12:
                raise ValueError("number too large")
            return _OPS[type(node.op)](left, right)
        raise ValueError("only integers, + - * // % and parentheses")

    try:
        return str(ev(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"


def tool_result(name: str, arguments: str) -> str:
    """What the agent sends back for one tool call (errors included, as text)."""
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    try:
        args = json.loads(arguments)
        return calculate(str(args["expression"]))
    except (ValueError, KeyError, TypeError) as e:
        return f"error: bad arguments ({e})"


def final_number(text: str | None) -> str | None:
    found = re.findall(r"-?\d+", text or "")
    return found[-1] if found else None


async def run(client: Any, item: dict[str, Any]) -> float:
    """One episode: ask, run the tool calls the model makes, score the final answer."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": item["prompt"]}]
    for _ in range(MAX_TURNS):
        resp = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        msg = resp.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return float(final_number(msg.content) == str(item["answer"]))
        for call in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": tool_result(call.function.name, call.function.arguments)})
    return 0.0  # still calling tools when its turns ran out


# ------------------------------------------------------------------ data (used by prepare.py)
def make_prompt(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def make_items(n: int, seed: int, exclude: set[tuple[int, int]] | None = None) -> list[dict[str, Any]]:
    """``n`` distinct pairs of 4-digit numbers as rows ``{prompt_id, prompt, answer, a, b}``."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    items: list[dict[str, Any]] = []
    while len(items) < n:
        a, b = rng.randint(1000, 9999), rng.randint(1000, 9999)
        if (a, b) in seen or (a % 1000 == 0 and b % 1000 == 0):  # the prepare.py guess would be right
            continue
        seen.add((a, b))
        items.append({"prompt_id": len(items), "prompt": make_prompt(a, b), "answer": str(a * b), "a": a, "b": b})
    return items
