"""Waiting for the servers' start-up warm-up before the first pause.

SGLang answers ``/model_info`` (the pool's readiness probe) before its start-up warm-up is
over: once listening, it sends itself one ``/generate`` and only then calls itself up
(``_execute_server_warmup`` in ``entrypoints/http_server.py``). That request waits like any
other while generation is paused, and when it has no answer within ``SGLANG_WARMUP_TIMEOUT``
(600 s by default) SGLang kills itself. So a weight push that pauses a server before its
warm-up request got there, and lasts longer than that, loses the server.

Before the first pause, every server in rotation is therefore asked until it says its
warm-up is over: ``/ready`` where it lists that route (200 once up and not paused, nothing
generated), else ``/health`` (503 at once until up, then one generated token). A server
that answers neither with 200 is continued once, in case a trainer that died mid-push left
it paused (then it is never ready); one still not warm after ``startup_timeout_s`` (the
client's start-up timeout) leaves the rotation for good, rather than be paused to death.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from arealite.inference_client.errors import ServerAdminError
from arealite.inference_client.http1 import HttpResponseTooLarge
from arealite.inference_client.server_pool import ServerPool, ServerState, read_body
from arealite.inference_client.wire import describe

logger = logging.getLogger(__name__)

__all__ = ["wait_until_warm"]

#: Longest single readiness request: SGLang's generating /health may wait 20 s for its token.
_REQUEST_TIMEOUT_S = 30.0


async def wait_until_warm(pool: ServerPool) -> None:
    """Return once every server in rotation has finished its start-up warm-up; those that
    have not within ``pool.startup_timeout_s`` leave the rotation for good (logged)."""
    cold = [s for s in pool.states if s.healthy and not s.warm]
    if not cold:
        return
    deadline = time.monotonic() + pool.startup_timeout_s
    causes = await asyncio.gather(*(_wait_one(pool, s, deadline) for s in cold))
    for s, cause in zip(cold, causes):
        if cause is None:
            s.warm = True
            continue
        pool.drop(s, f"its start-up warm-up was not over within {pool.startup_timeout_s:g}s ({cause}); "
                     "pausing it then could make SGLang kill itself")


def readiness_route(pool: ServerPool, s: ServerState) -> str:
    """The route that tells whether ``s``'s warm-up is over: the non-generating ready route
    where the server lists it, else the health route."""
    ready = pool.wire.ready_route
    return ready if ready is not None and s.serves(ready) else pool.wire.health_route


async def _wait_one(pool: ServerPool, s: ServerState, deadline: float) -> str | None:
    """None once ``s`` says its warm-up is over; else why not, at the deadline."""
    route = readiness_route(pool, s)
    continued, pause_s = False, 0.05
    while True:
        status = await _get_status(pool, s, route, deadline)
        if status == 200:
            return None
        if status in (401, 403):
            return f"{route} answered HTTP {status}: the server rejected the api key"
        if status == 404 and route != pool.wire.health_route:
            route = pool.wire.health_route  # it listed the route but does not serve it
            continue
        cause = f"{route} answered HTTP {status}" if isinstance(status, int) else f"{route}: {status}"
        if not isinstance(status, int):
            return cause  # it answered at start-up and no longer does: it is gone
        if not continued:
            continued = True
            try:  # never ready while left paused (by a trainer that died mid-push)
                await pool.call_all("/continue_generation", {}, servers=[s])
            except ServerAdminError as e:
                return f"{cause}; {e}"
        left = deadline - time.monotonic()
        if left <= 0:
            return cause
        await asyncio.sleep(min(pause_s, left))
        pause_s = min(pause_s * 2, 1.0)


async def _get_status(pool: ServerPool, s: ServerState, route: str, deadline: float) -> int | str:
    """The HTTP status of ``GET route`` on ``s``, or why there was none."""
    total = min(_REQUEST_TIMEOUT_S, max(0.5, deadline - time.monotonic()))
    try:
        async with pool.ensure_session().get(s.base_url + route,
                                             timeout=aiohttp.ClientTimeout(total=total)) as resp:
            await read_body(resp, pool.max_response_bytes)
            return resp.status
    except asyncio.TimeoutError:
        return 503  # a generating /health that got no token yet: ask again
    except (aiohttp.ClientError, HttpResponseTooLarge) as e:
        return describe(e)
