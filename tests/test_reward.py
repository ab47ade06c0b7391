"""Math final-answer extraction and the 1/0 math reward."""

from __future__ import annotations

import pytest

from arealite.reward.math import answers_match, extract_final_answer, math_reward


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so the answer is \boxed{42}.", "42"),
        (r"first \boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\{a, b\}_{i}} done", r"\{a, b\}_{i}"),
        (r"nested \boxed{x^{2^{3}}}", "x^{2^{3}}"),
        ("Let me think.\n#### 1,000\n", "1,000"),
        ("#### 3\nwait, actually\n#### 5", "5"),
        ("The total is 12 apples and 7 pears, so 19", "19"),
        ("it is -3.5 degrees", "-3.5"),
        ("no numbers here", None),
        (r"cut off \boxed{12", "12"),  # unbalanced box falls back to the last number
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


@pytest.mark.parametrize(
    "pred, ref, same",
    [
        ("1,000", "1000", True),
        ("3.0", "3", True),
        ("3", 3, True),
        ("1/2", "0.5", True),
        (r"\frac{1}{2}", "0.5", True),
        (r"-\frac{3}{4}", "-0.75", True),
        ("50%", "0.5", True),
        ("$7$", "7", True),
        ("7.", "7", True),
        ("12", "1,2", False),  # "1,2" is not a thousands separator
        ("3.01", "3", False),
        (r"\text{Paris}", "paris", True),
        ("x+1", "x + 1", True),
        ("x+1", "x+2", False),
        (None, "3", False),
        ("42", "the work...\n#### 42", True),
    ],
)
def test_answers_match(pred, ref, same):
    assert answers_match(pred, ref) is same


def test_math_reward_is_one_or_zero():
    assert math_reward("q", r"... \boxed{1,000}", answer="1000") == 1.0
    assert math_reward("q", "#### 999", answer=1000) == 0.0
    assert math_reward("q", "I don't know", [1], [2], answer="5", prompt_id=3) == 0.0


def test_math_reward_without_answer_names_the_field():
    with pytest.raises(KeyError, match="answer"):
        math_reward("q", "#### 1")
