"""The test suite's event loop: uvloop, one loop shared by async fixtures and tests.

A fixture on one loop awaited by a test on another hangs instead of failing,
so the scope is checked here once rather than discovered as a timeout.
"""

from __future__ import annotations

import asyncio

import pytest
import uvloop

_seen: list[asyncio.AbstractEventLoop] = []


@pytest.fixture(scope="session")
async def session_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


async def test_the_loop_is_uvloop():
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)


@pytest.mark.parametrize("round_", [0, 1])
async def test_fixtures_and_tests_share_one_loop(session_loop, round_):
    loop = asyncio.get_running_loop()
    assert loop is session_loop
    _seen.append(loop)
    assert all(seen is loop for seen in _seen)  # the second test runs on the first one's loop
