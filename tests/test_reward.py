"""Math final-answer extraction, the 1/0 math reward, and the reward thread pool."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from arealite.reward.math import answers_match, extract_final_answer, math_reward
from arealite.reward.pool import RewardError, RewardRunner


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


# ------------------------------------------------------------ reward thread pool


async def test_reward_runner_many_concurrent_calls_each_get_their_own_value():
    runner = RewardRunner(timeout_s=5, workers=3)
    seen_threads = set()

    def fn(x, *, scale):
        seen_threads.add(threading.current_thread().name)
        return x * scale

    before = threading.active_count()
    values = await asyncio.gather(*(runner(fn, i, scale=2) for i in range(300)))
    assert values == [2.0 * i for i in range(300)]
    assert seen_threads == {"arealite-reward"} and threading.active_count() - before <= 3
    assert runner.abandoned_threads == 0


async def test_reward_runner_timeout_counts_from_the_start_of_each_call():
    runner = RewardRunner(timeout_s=0.4, workers=1)
    # One worker, three calls of 0.25 s each: all succeed although the last one
    # waits 0.5 s in the queue (longer than the timeout) before it starts.
    t0 = time.monotonic()
    values = await asyncio.gather(*(runner(lambda: (time.sleep(0.25), 1.0)[1]) for _ in range(3)))
    assert values == [1.0] * 3 and time.monotonic() - t0 >= 0.7


async def test_reward_runner_hanging_call_is_abandoned_and_later_calls_go_on():
    runner = RewardRunner(timeout_s=0.2, workers=1)
    release = threading.Event()
    t0 = time.monotonic()
    hang = asyncio.ensure_future(runner(lambda: release.wait(10) and 0.0))
    await asyncio.sleep(0)
    quick = await asyncio.gather(*(runner(lambda i=i: float(i)) for i in range(5)))
    assert quick == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(RewardError, match="did not return within 0.2s"):
        await hang
    assert time.monotonic() - t0 < 2 and runner.abandoned_threads == 1
    release.set()  # the abandoned thread returns and exits; its result goes nowhere
    assert await runner(lambda: 7) == 7.0


async def test_reward_runner_cancelled_queued_call_never_runs():
    runner = RewardRunner(timeout_s=5, workers=1)
    gate, ran = threading.Event(), []
    first = asyncio.ensure_future(runner(lambda: gate.wait(5) and 1.0))
    second = asyncio.ensure_future(runner(lambda: ran.append(1) or 2.0))
    await asyncio.sleep(0.05)
    second.cancel()
    await asyncio.sleep(0)
    gate.set()
    assert await first == 1.0
    with pytest.raises(asyncio.CancelledError):
        await second
    assert await runner(lambda: 3.0) == 3.0 and ran == []


def test_reward_pool_is_still_importable_from_the_workflow_base():
    from arealite.workflow import base

    assert base.RewardRunner is RewardRunner and base.RewardError is RewardError


async def test_a_cheap_reward_runs_on_the_loop_and_fails_as_any_other():
    from arealite.reward.pool import cheap_reward

    runner = RewardRunner(timeout_s=5, workers=2)
    seen = []

    @cheap_reward
    def fn(x):
        seen.append(threading.current_thread())
        return {1: 1, 2: float("nan"), 3: "a"}.get(x, 0.5) if x != 4 else 1 / 0

    assert await runner(fn, 1) == 1.0 and await runner(fn, 0) == 0.5
    assert seen == [threading.current_thread()] * 2  # no worker thread
    for x, why in ((2, "returned nan"), (3, "returned str"), (4, "raised ZeroDivisionError")):
        with pytest.raises(RewardError, match=why):
            await runner(fn, x)
