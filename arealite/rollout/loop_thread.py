"""An event loop in a background thread, and the calls into it from other threads.

The rollout controller keeps all its mutable state on this loop: the trainer's
thread never touches it directly, only through `LoopThread.run` (a coroutine)
and `LoopThread.call` (a plain function run between two loop iterations), so
there are no locks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Coroutine, TypeVar

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


@dataclass(frozen=True)
class ProcessSettings:
    """What `tune_process` changed, to give back to `restore_process` (None: unchanged)."""

    switch_interval: float | None = None
    gc_threshold: tuple[int, ...] | None = None


def tune_process(switch_interval_ms: float | None, freeze_gc: bool,
                 gc_young_threshold: int | None = None) -> ProcessSettings:
    """Process-wide settings for a loop thread beside a training thread; returns what to give
    back to `restore_process`.

    The two threads share the GIL: a shorter switch interval bounds how long one waits for
    the other. ``gc.freeze()`` moves the objects alive so far (model, modules: ~10^5-10^6 in a
    trainer process) out of the collector's reach, so the collections the rollout's
    allocations trigger do not scan them all. ``gc_young_threshold`` spaces those
    collections out (``rollout.gc_young_threshold``).
    """
    old_interval = old_threshold = None
    if switch_interval_ms is not None:
        old_interval = sys.getswitchinterval()
        sys.setswitchinterval(switch_interval_ms / 1000)
    if freeze_gc:
        freeze_heap()
    if gc_young_threshold is not None:
        old_threshold = gc.get_threshold()
        gc.set_threshold(gc_young_threshold, *old_threshold[1:])
    return ProcessSettings(old_interval, old_threshold)


def restore_process(old: ProcessSettings | None) -> None:
    """Give back what `tune_process` changed."""
    if old is None:
        return
    if old.switch_interval is not None:
        sys.setswitchinterval(old.switch_interval)
    if old.gc_threshold is not None:
        gc.set_threshold(*old.gc_threshold)
