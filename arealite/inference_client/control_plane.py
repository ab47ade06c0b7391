"""The admin fan-out's own thread: one call to every server, apart from the rollout.

Why: the rollout's event loop also runs every answer that comes back, its workflow and its
reward. An admin call sent to 256 servers from that loop (a weight update's pause, load,
continue) resumes 256 times behind those callbacks, and its CPU cannot be told from theirs
(measured, 256 simulated servers: 45-47 ms of the loop thread's CPU during an update's
pause against 10-15 ms for a pause to idle servers). Here the exchanges of one fan-out
(writing each request, reading and judging each answer) run on an event loop of their
own, over keep-alive connections of their own, so that they queue behind nothing of the
rollout's and this thread's CPU clock is the fan-out's.

Who owns what:

- the control thread owns its loop and one `Http1Pool` per server (made on first use);
  nothing else touches them;
- `fan_out` may be called from any thread; what crosses over is immutable (addresses,
  route, request bodies as bytes) and what comes back are plain tuples through a
  concurrent future. The server pool's own state (rotation, the servers' pause, failure
  counts) stays with the rollout loop, which applies the answers (`ServerPool.call_all`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence

import uvloop

from arealite.inference_client.http1 import Http1Pool
from arealite.inference_client.wire import describe

__all__ = ["Answer", "ControlPlane"]

#: One server's side of a fan-out: (its answer judged, why it failed or None, no answer came).
Answer = tuple[object, str | None, bool]
#: Judges an answer that came: ``judge(status, body) -> (answer, why it failed or None)``.
Judge = Callable[[int, bytes], tuple[object, str | None]]


class ControlPlane:
    """An event loop in a daemon thread that sends admin calls to many servers at once.

    ``connections(addr)`` makes a new (unconnected) `Http1Pool` for a server; it is called on
    the control thread the first time that server is addressed.
    """

    def __init__(self, connections: Callable[[str], Http1Pool], name: str = "arealite-admin"):
        self._connections = connections
        self._pools: dict[str, Http1Pool] = {}  # the control thread's only
        self._warming: dict[str, asyncio.Task] = {}  # the control thread's only: `warm` under way
        self._loop = uvloop.new_event_loop()
        self._cpu_clock: int | None = None
        self._cpu_at_close = 0.0
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(self._loop)
            self._cpu_clock = time.pthread_getcpuclockid(threading.get_ident())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=main, name=name, daemon=True)
        self._thread.start()
        if not ready.wait(10.0):
            raise RuntimeError(f"the admin control thread {name!r} did not start within 10s")

    @property
    def thread_id(self) -> int | None:
        """The control thread's id (None once closed)."""
        return self._thread.ident if self._thread.is_alive() else None

    def cpu_s(self) -> float:
        """CPU seconds the control thread has used so far (its whole life, closed or not)."""
        if self._cpu_clock is None or not self._thread.is_alive():
            return self._cpu_at_close
        try:
            return time.clock_gettime(self._cpu_clock)
        except OSError:  # the thread ended between the check and the read
            return self._cpu_at_close

    def fan_out(self, addrs: Sequence[str], route: str, bodies: Sequence[bytes], timeout: float | None,
                max_body: int, judge: Judge) -> concurrent.futures.Future[list[Answer]]:
        """POST ``bodies[i]`` to ``route`` of ``addrs[i]``, all at once, on the control thread,
        each answer judged there by ``judge`` (a pure function: it runs on the control thread).

        Returns a future of one `Answer` per server, in order; await it on another loop with
        ``asyncio.wrap_future`` (cancelling that cancels the fan-out)."""
        if not self._loop.is_running():
            raise RuntimeError("the admin control thread is closed")
        return asyncio.run_coroutine_threadsafe(
            self._fan_out(list(addrs), route, list(bodies), timeout, max_body, judge), self._loop)

    async def _fan_out(self, addrs: list[str], route: str, bodies: list[bytes], timeout: float | None,
                       max_body: int, judge: Judge) -> list[Answer]:
        return list(await asyncio.gather(*(self._one(a, route, b, timeout, max_body, judge)
                                           for a, b in zip(addrs, bodies))))

    def warm(self, addrs: Sequence[str], timeout: float) -> None:
        """Open a connection to each server now unless a fresh one is idle, without waiting: a
        fan-out that follows uses it (it waits for the opening under way) rather than connecting
        on its own path. A server that cannot be reached is left to that fan-out to report."""
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._start_warming, list(addrs), timeout)

    def _start_warming(self, addrs: list[str], timeout: float) -> None:
        for addr in addrs:
            if addr not in self._warming:
                task = self._loop.create_task(self._conns(addr).warm(timeout))
                task.add_done_callback(lambda t, a=addr: self._warm_done(a, t))
                self._warming[addr] = task

    def _warm_done(self, addr: str, task: asyncio.Task) -> None:
        if self._warming.get(addr) is task:
            del self._warming[addr]
        if not task.cancelled():
            task.exception()  # read, so that it is not logged: the fan-out reports the server

    def _conns(self, addr: str) -> Http1Pool:
        conns = self._pools.get(addr)
        if conns is None:
            conns = self._pools[addr] = self._connections(addr)
        return conns

    async def _one(self, addr: str, route: str, body: bytes, timeout: float | None, max_body: int,
                   judge: Judge) -> Answer:
        warming = self._warming.get(addr)
        if warming is not None:
            await asyncio.wait([warming], timeout=timeout)
        conns = self._conns(addr)
        try:
            status, raw = await conns.post(route, body, timeout, max_body=max_body)
        except TimeoutError:
            return None, f"no answer within {timeout:g}s", True
        except ConnectionError as e:  # Http1Pool's errors (connection, protocol, too large)
            return None, describe(e), True
        return (*judge(status, raw), False)

    def connection_stats(self, timeout: float = 5.0) -> dict[str, dict[str, int]]:
        """``{addr: {"idle": n, "live": n}}`` of the control thread's connections (read there)."""
        async def read() -> dict[str, dict[str, int]]:
            return {a: conns.stats() for a, conns in self._pools.items()}

        return asyncio.run_coroutine_threadsafe(read(), self._loop).result(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Close every connection and end the thread (safe to call twice, from any thread
        but the control thread itself)."""
        if not self._thread.is_alive():
            return

        async def shut() -> None:
            for task in list(self._warming.values()):
                task.cancel()
            for conns in self._pools.values():
                await conns.aclose()
            self._pools.clear()

        try:
            asyncio.run_coroutine_threadsafe(shut(), self._loop).result(timeout)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass  # the loop is gone or stuck: the daemon thread ends with the process
        self._cpu_at_close = self.cpu_s()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()
