"""Code rewards: run generated Python in the sandbox (`arealite.sandbox`).

- ``unit_test_reward`` (a ``data.reward_fn``): the completion's code (the last fenced
  ```python block, else the whole text) followed by the item's ``tests`` (asserts, or
  ``unittest`` code); reward 1.0 when the run exits cleanly within the limits, else 0.0.
- ``run_snippet``: a tool for agents: run a snippet, get its output as text.

Limits are the config's ``agent.sandbox`` (`configure` is called when the run's
workflow is built), or `SandboxConfig`'s defaults.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from arealite.sandbox import SandboxResult, arun_python, run_python
from arealite.config.agent import SandboxConfig
from arealite.utils.json_types import JsonValue

__all__ = ["configure", "extract_code", "run_snippet", "unit_test_reward"]

_LIMITS = SandboxConfig()
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def configure(limits: SandboxConfig) -> None:
    """Set the limits the functions of this module use (the run's ``agent.sandbox``)."""
    global _LIMITS
    _LIMITS = limits


def extract_code(text: str) -> str:
    """The last fenced Python block of ``text``, else ``text`` itself."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def unit_test_reward(prompt: str, completion: str, prompt_ids: Sequence[int] | None = None,
                     completion_ids: Sequence[int] | None = None, *, tests: str, **_: JsonValue) -> float:
    """1.0 when the completion's code passes the item's ``tests`` in the sandbox, else 0.0."""
    code = extract_code(completion) + "\n\n# --- tests ---\n" + tests + "\n"
    return 1.0 if run_python(code, _LIMITS).ok else 0.0


def _as_text(res: SandboxResult) -> str:
    if res.timed_out:
        return f"TimeoutError: the code ran longer than {_LIMITS.wall_s:g}s\n{res.stdout}"
    out = res.stdout + (("\n" if res.stdout else "") + res.stderr if res.returncode != 0 else "")
    if res.signal:
        out += f"\nKilled by {res.signal}"
    return out + ("\n[output truncated]" if res.output_truncated else "")


async def run_snippet(code: str) -> str:
    """Run ``code`` in the sandbox and return what it printed (and its error, if it failed)."""
    return _as_text(await arun_python(code, _LIMITS))
