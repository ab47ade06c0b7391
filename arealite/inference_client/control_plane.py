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
from typing import Protocol

import uvloop

from arealite.inference_client.errors import ServerAdminError
from arealite.inference_client.http1 import Http1Pool
from arealite.inference_client.wire import describe, error_message, loads
from arealite.utils.json_types import JsonValue

__all__ = ["AdminCalls", "Answer", "ControlPlane", "judge_answer", "results_of"]

#: How long the admin's idle connections are reused. Longer than the generation path's 2 s:
#: admin calls come once per step, a connection the server closes meanwhile is seen at once
#: (its EOF) and dropped, and one closed just as it is reused is resent once on a fresh one
#: (`Http1Pool`). Connecting anew costs ~70 us of CPU a server (256 simulated servers: 29 ms
#: of CPU for a pause against 10 ms over open connections).
ADMIN_IDLE_S = 30.0

#: One server's side of a fan-out: (its answer judged, why it failed or None, no answer came).
Answer = tuple[object, str | None, bool]


class _Target(Protocol):
    addr: str


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


def judge_answer(status: int, raw: bytes) -> tuple[JsonValue, str | None]:
    """An admin call's answer: (parsed answer, None) or (answer, why it failed: an HTTP error
    or ``success: false``)."""
    try:
        result: JsonValue = loads(raw) if raw else None
    except ValueError:
        result = raw.decode("utf-8", "replace")
    if status != 200:
        return result, f"HTTP {status}: {error_message(raw)}"
    if isinstance(result, dict) and result.get("success") is False:
        return result, f"success false: {result.get('message', '(no message)')}"
    return result, None


def results_of(route: str, addrs: Sequence[str], answers: Sequence[tuple]) -> dict[str, JsonValue]:
    """``{addr: answer}`` of a fan-out whose ``answers`` are ``(answer, why it failed or None, ...)``;
    raises `ServerAdminError` naming every server that failed."""
    results = {a: x[0] for a, x in zip(addrs, answers) if x[1] is None}
    failures = {a: x[1] for a, x in zip(addrs, answers) if x[1] is not None}
    if failures:
        raise ServerAdminError(route, failures, results)
    return results


class AdminCalls:
    """The rollout loop's side of the admin's thread: makes the `ControlPlane` on first use
    (from any thread: ``_lock`` guards it), hands fan-outs over and applies their answers,
    keeps the CPU they cost. ``headers`` go with every request."""

    def __init__(self, owner: str, headers: dict[str, str] | None, max_body: int):
        self._owner, self._headers, self._max_body = owner, headers, max_body
        self._lock = threading.Lock()
        self.control: ControlPlane | None = None
        self.closed = False
        self.loop_cpu_s = 0.0  # CPU the rollout loop spent on admin calls; written there only

    def plane(self) -> ControlPlane:
        """The admin's thread (started on first use)."""
        with self._lock:
            if self.closed:
                raise RuntimeError(f"{self._owner} is closed (aclose() was called)")
            if self.control is None:
                self.control = ControlPlane(self._connections, name=f"{self._owner}-admin")
            return self.control

    def warm(self, addrs: Sequence[str], timeout: float) -> None:
        """`ControlPlane.warm` (any thread; nothing once closed)."""
        try:
            self.plane().warm(addrs, timeout)
        except RuntimeError:  # closed meanwhile: nothing to warm
            pass

    def _connections(self, addr: str) -> Http1Pool:
        host, _, port = addr.rpartition(":")
        return Http1Pool(host.strip("[]"), int(port), self._headers, max_idle_s=ADMIN_IDLE_S, max_body=self._max_body)

    async def call(self, targets: Sequence[_Target], route: str, bodies: Sequence[bytes], timeout: float,
                   on_no_answer: Callable[[_Target], None], cpu0: float) -> dict[str, JsonValue]:
        """POST ``bodies[i]`` to ``targets[i]`` on the admin's thread; ``on_no_answer(target)``
        for each that did not answer (on this loop), then `results_of`. The CPU this loop
        spends on the call since ``cpu0`` (its ``time.thread_time()``) counts in `cpu_s`."""
        addrs = [t.addr for t in targets]
        fut = self.plane().fan_out(addrs, route, bodies, timeout, self._max_body, judge_answer)
        self.count_since(cpu0)
        answers = await asyncio.wrap_future(fut)
        cpu1 = time.thread_time()
        try:
            for t, (_, _, no_answer) in zip(targets, answers):
                if no_answer:
                    on_no_answer(t)
            return results_of(route, addrs, answers)
        finally:
            self.count_since(cpu1)

    def count_since(self, cpu0: float) -> None:
        """Count the calling (rollout) loop's CPU since ``cpu0`` as the admin calls'."""
        self.loop_cpu_s += time.thread_time() - cpu0

    def cpu_s(self) -> float:
        """CPU seconds of the admin calls so far: the admin's thread plus the rollout loop's
        share (any thread may read it; a difference of two readings is the CPU between them)."""
        control = self.control
        return (control.cpu_s() if control is not None else 0.0) + self.loop_cpu_s

    def close(self) -> None:
        with self._lock:
            self.closed = True
            control = self.control
        if control is not None:
            control.close()
