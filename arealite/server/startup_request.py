"""SGLang's start-up warm-up, as the strict embedded server models it.

Once its HTTP server listens, SGLang sends itself one short ``/generate`` and only then
calls itself up: ``/health`` answers 503 without generating and ``/ready`` 503 until then,
while ``/model_info`` answers from the start. That request is an ordinary one: while
generation is paused it waits, and when it gets no answer within its timeout
(``SGLANG_WARMUP_TIMEOUT``) the server kills itself (``_execute_server_warmup`` in
``entrypoints/http_server.py``). A client that pauses a server before its warm-up is
over, for longer than that timeout, loses the server.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from .strict import SGLangBehaviour

logger = logging.getLogger("arealite.server")

__all__ = ["WarmUp", "self_url"]

#: SGLang's warm-up request with ``--skip-tokenizer-init``: 8 greedy tokens of a 3-token prompt.
WARMUP_BODY = {"input_ids": [10, 11, 12], "sampling_params": {"temperature": 0, "max_new_tokens": 8}}


def self_url(host: str, port: int) -> str:
    """The URL this server reaches itself at (a wildcard bind is reached over loopback)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


class WarmUp:
    """Where the start-up warm-up stands: ``starting`` until its request is answered, then
    ``up``; ``failed`` when it was not (the server then stops). Without a modelled warm-up
    (not strict, or ``--skip-server-warmup``) the server is ``up`` from the start."""

    def __init__(self, behaviour: SGLangBehaviour):
        self.behaviour = behaviour
        self.status = "starting" if behaviour.warmup else "up"
        self.failure = ""

    @property
    def up(self) -> bool:
        """Whether the warm-up is over (SGLang's ``ServerStatus.Up``)."""
        return self.status == "up"

    @property
    def starting(self) -> bool:
        return self.status == "starting"

    async def run(self, url: str, api_key: str | None, on_failure: Callable[[], None]) -> None:
        """Send the warm-up request to ``url`` after the configured delay; ``up`` on a 200,
        else ``failed`` and ``on_failure()`` (which stops the server)."""
        if not self.starting:
            return
        b = self.behaviour
        await asyncio.sleep(b.warmup_delay_s)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        try:
            async with aiohttp.ClientSession(trust_env=False) as session:
                async with session.post(url + "/generate", json=WARMUP_BODY, headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=b.warmup_timeout_s)) as resp:
                    text = await resp.text()
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {text[:200]}")
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as e:
            self.status = "failed"
            self.failure = (f"the start-up warm-up /generate got no answer within SGLANG_WARMUP_TIMEOUT="
                            f"{b.warmup_timeout_s:g}s ({type(e).__name__}: {e}); the server stops, as SGLang's "
                            "does (was generation paused before the warm-up was over?)")
            logger.error("%s", self.failure)
            on_failure()
            return
        self.status = "up"
        logger.info("start-up warm-up done: the server is up")
