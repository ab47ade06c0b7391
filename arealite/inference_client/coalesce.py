"""One HTTP exchange for the requests of a group: its samples as one batched ``/generate``.

The samples of a GRPO group are submitted in the same turn of the event loop, to the same
server (they share an affinity key), and their workflow waits for all of them. Sent one by
one they cost the client and the server n HTTP exchanges (connection, headers, JSON, a
task each); in the backend's batch form (SGLang: lists of ``input_ids``, ``sampling_params``
and ``rid``, answered by a list in the same order) they cost one. Each request keeps its own
life: its slot on the server, its retries, its resubmission after an abort. Only the
exchange is shared:

- the first request of a key on a server opens a batch and lets the loop run once; the
  requests of that key that reach the server in the same turn join it; then the opener
  sends it (a batch of one goes out in the plain form);
- a 200 answer is split by position and each request reads, and checks, its own part;
- a failed exchange (timeout, lost connection, 5xx, an answer too large or not a list of the
  right length) is a failed attempt of every member, each retried on its own;
- a batch refused with a 4xx is sent again one request at a time, so that only the request
  at fault fails; when the opener's request then passes alone, the server (or a router in
  front of it) has no batch form, and its requests go one at a time from then on;
- a member whose caller cancels it stops waiting; if the opener is cancelled, the others
  send their requests themselves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from arealite.inference_client.wire import WireFormat, dumps, encode_request
from arealite.utils.json_types import JsonObject, JsonValue

logger = logging.getLogger(__name__)

__all__ = ["Post", "RequestBatcher", "SharedFailure", "refused_by_client", "retryable_status"]

#: ``post(body, max_body)`` -> (HTTP status, response body): one exchange with one server.
Post = Callable[[bytes, int], Awaitable[tuple[int, bytes]]]

_RETRYABLE_4XX = (408, 429)  # request timeout / too many requests: the server's state, not ours


def retryable_status(status: int) -> bool:
    """A non-200 answer another attempt may not get: 5xx, 408 or 429 (the server's state)."""
    return status >= 500 or status in _RETRYABLE_4XX


def refused_by_client(status: int) -> bool:
    """A 4xx that blames the request (not 408 or 429, which say the server is busy)."""
    return 400 <= status < 500 and status not in _RETRYABLE_4XX


class _SendAlone(Exception):
    """The batch could not carry this request: it goes out on its own."""


class SharedFailure(Exception):
    """The exchange of a batch this request joined failed with ``error`` (or answered
    ``status`` with ``raw``); the member that sent it counts that against the server."""

    def __init__(self, error: BaseException | None, status: int = 0, raw: bytes = b""):
        super().__init__(str(error) if error is not None else f"HTTP {status}")
        self.error, self.status, self.raw = error, status, raw


class _Batch:
    __slots__ = ("key", "bodies", "waiters")

    def __init__(self, key: tuple[str, str], body: JsonObject):
        self.key = key
        self.bodies = [body]
        self.waiters: list[asyncio.Future | None] = [None]  # the opener awaits nothing


class RequestBatcher:
    """Joins the requests of one key bound for one server into batched exchanges.

    ``max_body``: the largest answer accepted for one request; a batch of n accepts n times it.
    """

    def __init__(self, wire: WireFormat, max_body: int):
        self.wire = wire
        self.max_body = int(max_body)
        self._open: dict[tuple[str, str], _Batch] = {}
        self._plain: set[str] = set()  # servers that refused the batch form
        self.counts = {"batched_requests": 0, "batches": 0, "batches_split": 0}

    async def send(self, addr: str, key: str, body: JsonObject, post: Post) -> tuple[int, bytes | JsonValue]:
        """Send ``body`` to ``addr`` (``post`` is that server's exchange), batched with the
        requests of ``key`` sent in the same turn of the loop.

        Returns (status, answer): the answer is the raw body when the request went alone or
        the exchange failed with a status, else this request's part of the batch's parsed
        answer. Raises what ``post`` raises, or `SharedFailure` when the batch this request
        joined (and did not send) failed.
        """
        if addr in self._plain:
            return await post(encode_request(body), self.max_body)
        batch = self._open.get((addr, key))
        if batch is not None:
            fut = asyncio.get_running_loop().create_future()
            batch.bodies.append(body)
            batch.waiters.append(fut)
            try:
                return await fut
            except _SendAlone:
                return await post(encode_request(body), self.max_body)
        batch = self._open[(addr, key)] = _Batch((addr, key), body)
        try:
            await asyncio.sleep(0)  # the rest of the group joins in this turn of the loop
        except BaseException:
            self._close(batch)
            self._release(batch, _SendAlone())
            raise
        self._close(batch)
        if len(batch.bodies) == 1:
            return await post(encode_request(body), self.max_body)
        return await self._send_batch(batch, post)

    def _close(self, batch: _Batch) -> None:
        if self._open.get(batch.key) is batch:
            del self._open[batch.key]

    async def _send_batch(self, batch: _Batch, post: Post) -> tuple[int, bytes | JsonValue]:
        n = len(batch.bodies)
        self.counts["batches"] += 1
        self.counts["batched_requests"] += n
        try:
            body = dumps(self.wire.batch_body(batch.bodies))
        except TypeError:  # a member holds a non-JSON value: alone, it alone fails
            self._release(batch, _SendAlone())
            return await post(encode_request(batch.bodies[0]), self.max_body)
        try:
            status, raw = await post(body, self.max_body * n)
        except asyncio.CancelledError:
            self._release(batch, _SendAlone())
            raise
        except Exception as e:
            self._release(batch, SharedFailure(e))
            raise
        if status != 200:
            if refused_by_client(status):
                self.counts["batches_split"] += 1
                self._release(batch, _SendAlone())
                status, raw = await post(encode_request(batch.bodies[0]), self.max_body)
                if status == 200 and batch.key[0] not in self._plain:
                    # Taken alone, not in a batch: a server (or a router before it, such as
                    # sglang-router, which refuses a list of rids) without the batch form.
                    self._plain.add(batch.key[0])
                    logger.warning("%s refused a batched request and took its first request alone: "
                                   "requests go to it one at a time from now on", batch.key[0])
                return status, raw
            self._release(batch, SharedFailure(None, status, raw))
            return status, raw
        try:
            parts = self.wire.split_batch(raw, n)
        except Exception as e:
            self._release(batch, SharedFailure(e))
            raise
        self._release(batch, None, [(200, p) for p in parts])
        return 200, parts[0]

    @staticmethod
    def _release(batch: _Batch, error: BaseException | None,
                 results: list[tuple[int, JsonValue]] | None = None) -> None:
        """Hand every waiting member its result (or ``error``)."""
        for i, fut in enumerate(batch.waiters):
            if fut is None or fut.done():
                continue
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(results[i])
