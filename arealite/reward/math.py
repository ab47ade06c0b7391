"""Verifiable math rewards: extract the final answer, compare it with the reference.

Extraction order: the last ``\\boxed{...}`` (nested braces allowed), else the
last ``#### answer`` line (GSM8K style), else the last number in the text.
Comparison normalises "1,000" == "1000", "3.0" == "3", "1/2" == "0.5" ==
"\\frac{1}{2}". When the optional ``math-verify`` package is installed it is
asked first (symbolic equivalence); our own comparison is the fallback.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction

from arealite.utils.json_types import JsonValue

try:  # optional: pip install math-verify
    from math_verify import parse as _mv_parse, verify as _mv_verify
except ImportError:  # pragma: no cover - depends on the environment
    _mv_parse = _mv_verify = None

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_HASHES = re.compile(r"####\s*([^\n]+)")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
        j += 1
    return None  # unbalanced: the model was cut off inside the box


def extract_final_answer(text: str) -> str | None:
    """The final answer of a completion as a string, or ``None`` if there is none."""
    if not isinstance(text, str):
        raise TypeError(f"completion must be a string, got {type(text).__name__}")
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    hashes = _HASHES.findall(text)
    if hashes:
        return hashes[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _to_number(s: str) -> Fraction | None:
    """Exact value of a numeric answer ("1,000", "3.0", "-1/2", "\\frac{1}{2}", "50%"), else None."""
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\(?:text|mathrm)\{([^}]*)\}", r"\1", s)
    s = s.replace("\\!", "").replace("\\,", "").replace(" ", "")
    s = s.rstrip(".")
    m = re.fullmatch(r"(-?)\\d?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s)
    if m:
        try:
            value = Fraction(m.group(2)) / Fraction(m.group(3))
        except (ValueError, ZeroDivisionError):
            return None
        return -value if m.group(1) else value
    percent = s.endswith("%")
    s = s.rstrip("%")
    # Thousands separators only where they are separators ("1,000", not "1,2").
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    try:
        value = Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if percent else value


def _normalise_text(s: str) -> str:
    s = s.strip().strip("$").strip().rstrip(".")
    s = re.sub(r"\\(?:text|mathrm)\{([^}]*)\}", r"\1", s)
    return re.sub(r"\s+", "", s).lower()


def answers_match(pred: str | None, ref: JsonValue) -> bool:
    """Whether an extracted answer equals the reference answer."""
    if pred is None or ref is None:
        return False
    ref_s = str(ref)
    # A reference written GSM8K-style carries its answer after ####.
    if "####" in ref_s:
        ref_s = _HASHES.findall(ref_s)[-1]
    if _mv_verify is not None:
        try:
            if _mv_verify(_mv_parse(f"${ref_s}$"), _mv_parse(f"${pred}$")):
                return True
        except Exception:  # math-verify is best effort; our comparison decides
            pass
    a, b = _to_number(pred), _to_number(ref_s)
    if a is not None and b is not None:
        return a == b
    return _normalise_text(pred) == _normalise_text(ref_s)


def math_reward(prompt: str, completion: str, prompt_ids: Sequence[int] | None = None,
                completion_ids: Sequence[int] | None = None, answer: JsonValue = None, **_: JsonValue) -> float:
    """1.0 if the completion's final answer equals ``answer``, else 0.0.

    The signature is the workflows' ``reward_fn`` one; ``answer`` comes from
    the dataset item's answer field.
    """
    if answer is None:
        raise KeyError(
            "math_reward needs the reference answer: the dataset item has no 'answer' field "
            "(set data.answer_key, or rename the field)"
        )
    return 1.0 if answers_match(extract_final_answer(completion), answer) else 0.0
