"""An event loop in a background thread, and the calls into it from other threads.

The rollout controller keeps all its mutable state on this loop: the trainer's
thread never touches it directly, only through `LoopThread.run` (a coroutine)
and `LoopThread.call` (a plain function run between two loop iterations), so
there are no locks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import threading
from typing import Any, Callable, Coroutine, Iterator, TypeVar

import torch
import uvloop

from arealite.utils.heap import freeze_heap

T = TypeVar("T")


class ControllerStopped(RuntimeError):
    """The controller was used before ``start()`` or after ``stop()``."""


class LoopThread:
    """A uvloop event loop running in a daemon thread named ``name``."""

    def __init__(self, name: str):
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self.loop is not None

    def start(self) -> None:
        """Start the thread; return once its loop runs."""
        if self.thread is not None:
            raise RuntimeError("controller already started")
        loop = self.loop = uvloop.new_event_loop()
        ready = threading.Event()

        def _main() -> None:
            # One intra-op thread on this thread only (the setting is per thread): the loop
            # builds small tensors, and a torch op that goes parallel here leaves an OpenMP
            # worker spin-waiting after it, which cost ~90 us of CPU per trajectory, taken
            # from the servers and the trainer on a small machine.
            torch.set_num_threads(1)
            asyncio.set_event_loop(loop)
            ready.set()
            loop.run_forever()

        self.thread = threading.Thread(target=_main, name=self.name, daemon=True)
        self.thread.start()
        ready.wait()

    def stop(self, shutdown: Callable[[], Coroutine[Any, Any, None]], timeout: float) -> None:
        """Run ``shutdown()`` on the loop (if it runs), then stop the loop and join the thread."""
        if self.thread is None or self.loop is None:
            return
        try:
            if self.loop.is_running():
                asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout)
            if not self.thread.is_alive():
                self.loop.close()
            self.thread = None
            self.loop = None

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the loop from another thread and return its result."""
        if self.loop is None:
            coro.close()
            raise ControllerStopped("controller is not running: call start() first")
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("run() was called from the controller's own loop; await the coroutine instead")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            if fut.done():  # the coroutine itself raised TimeoutError (same class since 3.11)
                raise
            fut.cancel()
            raise TimeoutError(f"coroutine did not finish within {timeout}s") from None
        except BaseException:  # Ctrl-C in the caller's thread: do not leave the coroutine running
            fut.cancel()
            raise

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run a plain function on the loop thread (atomically with respect to the loop)."""

        async def _wrap() -> T:
            return fn(*args)

        return self.run(_wrap())


async def cancel_other_tasks() -> None:
    """Cancel every task of the running loop but the caller's, and wait for them to end."""
    rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in rest:
        t.cancel()
    await asyncio.gather(*rest, return_exceptions=True)


def freeze_gc_heap(freeze_gc: bool) -> None:
    """``gc.freeze()`` moves the objects alive so far (model, modules: ~10^5-10^6 in a trainer
    process) out of the collector's reach, so the collections the rollout's allocations
    trigger do not scan them all."""
    if freeze_gc:
        freeze_heap()


class SwitchInterval:
    """The process's GIL switch interval while a controller runs (``rollout.gil_switch_interval_ms``).

    The loop thread and a training thread share the GIL: a shorter interval bounds how long
    one waits for the other. While the caller waits on the loop for a batch (`waiting`), no
    thread of its wants the GIL back, and a short interval only makes the loop and the reward
    threads hand it to each other more often (bench_controller, Nov 27, on a 2-core machine
    shared by other jobs: 0.82 context switches per trajectory instead of 1.02, 7 rounds; CPU
    per trajectory 36 us less in one A/B of 5 rounds, within the noise in two others). So
    Python's own interval holds during such waits, the short one the rest of the time (training).
    """

    def __init__(self, ms: float | None):
        self.ms = ms
        self._old: float | None = None  # the interval to give back; None while not applied
        self._waiting = 0  # callers inside `waiting()`
        self._lock = threading.Lock()

    def apply(self) -> None:
        if self.ms is not None and self._old is None:
            self._old = sys.getswitchinterval()
            sys.setswitchinterval(self.ms / 1000)

    def restore(self) -> None:
        with self._lock:
            if self._old is not None:
                sys.setswitchinterval(self._old)
                self._old = None

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Python's own interval for the duration (nested and concurrent callers counted)."""
        with self._lock:
            self._waiting += 1
            if self._waiting == 1 and self._old is not None:
                sys.setswitchinterval(self._old)
        try:
            yield
        finally:
            with self._lock:
                self._waiting -= 1
                if self._waiting == 0 and self._old is not None and self.ms is not None:
                    sys.setswitchinterval(self.ms / 1000)
