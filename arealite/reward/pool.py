"""Reward functions run off the event loop: a small thread pool with a per-call timeout.

A workflow awaits ``RewardRunner(fn, *args)``; the call runs in a worker thread,
so a slow (or hanging) reward function never blocks the rollout event loop.
Every failure (an exception, a timeout, a non-number, NaN) comes back as one
``RewardError`` the workflow can count and handle.
"""

from __future__ import annotations

import asyncio
import collections
import math
import queue
import threading
import time
from typing import Any, Callable

import torch


class RewardError(RuntimeError):
    """A reward function raised, timed out or returned a non-number."""


#: The attribute `cheap_reward` sets on a function.
_CHEAP = "arealite_cheap_reward"


def cheap_reward(fn: Callable[..., object]) -> Callable[..., object]:
    """Declare a reward function cheap: pure Python that returns in microseconds and never
    blocks. `RewardRunner` then calls it on the event loop itself, without a thread hop and
    without a timeout (its errors and non-numbers are reported as for any other). On
    bench_controller's path the hop costs ~13-16 us of CPU and ~0.4 context switches per
    episode (benchmarks/controller_costs.py --reward-inline). Returns ``fn``."""
    setattr(fn, _CHEAP, True)
    return fn


class _RewardJob:
    """One reward call; ``state`` moves under ``RewardRunner._lock``."""

    __slots__ = ("fn", "args", "kwargs", "fut", "box", "state", "started", "ok", "value")

    def __init__(self, fn: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object],
                 fut: asyncio.Future[object], box: "_LoopBox"):
        self.fn, self.args, self.kwargs, self.fut, self.box = fn, args, kwargs, fut, box
        self.state = _QUEUED
        self.started = 0.0  # time.monotonic() when a worker took it
        self.ok = False
        self.value: Any = None


# Job states. QUEUED: waiting for a worker; STARTED: running; FINISHED: result posted;
# CANCELLED (before it started) / ABANDONED (timed out while running): nobody waits.
_QUEUED, _STARTED, _FINISHED, _CANCELLED, _ABANDONED = range(5)


class _LoopBox:
    """Per-event-loop state of a ``RewardRunner``: calls in flight, timer, results mailbox."""

    __slots__ = ("loop", "inflight", "timer", "done", "wake_pending")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        # Calls not yet delivered, in submission order (= start order: the job queue is FIFO),
        # so one timer watching the oldest replaces a timer per call.
        self.inflight: collections.OrderedDict[_RewardJob, None] = collections.OrderedDict()
        self.timer: asyncio.TimerHandle | None = None
        self.done: collections.deque[_RewardJob] = collections.deque()  # filled by workers
        self.wake_pending = False


class RewardRunner:
    """Runs synchronous reward functions off the event loop, with a timeout.

    A small pool of daemon worker threads (``workers`` at once) runs the calls
    in submission order. A call that runs longer than ``timeout_s`` (counted
    from when a worker takes it, not from when it was queued) is abandoned:
    its thread is replaced at once and exits when the call finally returns,
    so a reward function that hangs can neither block the loop, starve later
    calls, nor keep the interpreter from exiting. Idle workers exit after
    ``idle_s``.

    Cheap per call, because it runs once per sample on the rollout hot path:
    calls are queued at once (a worker that holds the GIL runs many in a row,
    rather than one per loop round trip), one timer per loop watches the
    oldest call instead of one timer per call, and workers hand results back
    in batches (one loop wake-up pending at a time).
    """

    def __init__(self, timeout_s: float = 15.0, workers: int = 2, idle_s: float = 30.0):
        if timeout_s <= 0:
            raise ValueError(f"reward timeout_s must be > 0, got {timeout_s}")
        if workers < 1:
            raise ValueError(f"reward workers must be >= 1, got {workers}")
        self.timeout_s = timeout_s
        self.workers = workers
        self.idle_s = idle_s
        self.abandoned_threads = 0
        self._boxes: dict[asyncio.AbstractEventLoop, _LoopBox] = {}
        self._last: _LoopBox | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live = 0  # workers not stuck in an abandoned call

    # ---------------------------------------------------------- worker side
    def _worker(self) -> None:
        # Reward calls run side by side on several workers: one intra-op thread each
        # (per-thread setting), so that a torch op in a reward function does not leave
        # an OpenMP team per worker spin-waiting.
        torch.set_num_threads(1)
        lock, jobs, monotonic = self._lock, self._jobs, time.monotonic
        while True:
            try:
                job = jobs.get(timeout=self.idle_s)
            except queue.Empty:
                with lock:
                    if jobs.empty():
                        self._live -= 1
                        return
                continue
            with lock:
                if job.state != _QUEUED:  # cancelled before it started
                    continue
                job.state = _STARTED
                job.started = monotonic()
            try:
                job.value, job.ok = job.fn(*job.args, **job.kwargs), True
            except BaseException as e:  # reported to the workflow, never lost
                job.value, job.ok = e, False
            with lock:
                if job.state == _ABANDONED:
                    return  # a replacement worker was started when this call timed out
                job.state = _FINISHED
            box = job.box
            box.done.append(job)
            # One wake-up covers every result appended before the loop drains (see _drain).
            if not box.wake_pending:
                box.wake_pending = True
                try:
                    box.loop.call_soon_threadsafe(self._drain, box)
                except RuntimeError:  # the loop closed meanwhile: nobody waits any more
                    pass

    def _spawn_workers(self) -> None:
        # caller holds self._lock
        while self._live < self.workers:
            self._live += 1
            threading.Thread(target=self._worker, name="arealite-reward", daemon=True).start()

    # ------------------------------------------------------------ loop side
    def _box(self) -> _LoopBox:
        loop = asyncio.get_running_loop()
        box = self._last
        if box is None or box.loop is not loop:
            box = self._boxes.get(loop)
            if box is None:
                for old in [lp for lp in self._boxes if lp.is_closed()]:
                    del self._boxes[old]
                box = self._boxes[loop] = _LoopBox(loop)
            self._last = box
        return box

    def _drain(self, box: _LoopBox) -> None:
        # Clear the flag first: a result appended after this line schedules a new drain.
        box.wake_pending = False
        done, inflight = box.done, box.inflight
        while done:
            job = done.popleft()
            inflight.pop(job, None)
            if not job.fut.done():
                job.fut.set_result(None)

    def _arm(self, box: _LoopBox, delay: float) -> None:
        box.timer = box.loop.call_later(delay, self._on_timer, box)

    def _on_timer(self, box: _LoopBox) -> None:
        box.timer = None
        inflight = box.inflight
        now = time.monotonic()
        while inflight:
            job = next(iter(inflight))
            with self._lock:
                state = job.state
                if state == _STARTED and now - job.started >= self.timeout_s:
                    job.state = state = _ABANDONED
                    self.abandoned_threads += 1
                    self._live -= 1
                    self._spawn_workers()
            if state == _QUEUED:  # later calls are queued too; look again soon after it starts
                self._arm(box, min(self.timeout_s, 0.05))
                return
            if state == _STARTED:
                self._arm(box, job.started + self.timeout_s - now)
                return
            inflight.pop(job)
            if state == _ABANDONED and not job.fut.done():
                job.fut.set_result(_TIMED_OUT)
            # FINISHED: _drain delivers it; CANCELLED: nobody waits

    def _cancel(self, box: _LoopBox, job: _RewardJob) -> None:
        with self._lock:
            if job.state == _QUEUED:
                job.state = _CANCELLED  # the worker that takes it skips it
        if job.state == _CANCELLED:
            box.inflight.pop(job, None)
        # STARTED: it runs on, and its result is dropped when it arrives

    async def __call__(self, fn: Callable[..., object], *args: object, **kwargs: object) -> float:
        """``float(fn(*args, **kwargs))`` in a worker thread (here for a `cheap_reward`);
        raises ``RewardError`` on any failure."""
        if getattr(fn, _CHEAP, False):
            try:
                value, ok = fn(*args, **kwargs), True
            except Exception as e:  # reported to the workflow, as from a worker
                value, ok = e, False
            return _checked(fn, ok, value)
        box = self._box()
        job = _RewardJob(fn, args, kwargs, box.loop.create_future(), box)
        box.inflight[job] = None
        with self._lock:  # with the put, so that an idle worker cannot exit past this job
            if self._live < self.workers:
                self._spawn_workers()
            self._jobs.put(job)
        if box.timer is None:
            self._arm(box, self.timeout_s)
        try:
            result = await job.fut
        except asyncio.CancelledError:
            self._cancel(box, job)
            raise
        if result is _TIMED_OUT:
            raise RewardError(
                f"reward function {_name(fn)!r} did not return within {self.timeout_s}s (rollout.reward_timeout_s)"
            )
        return _checked(fn, job.ok, job.value)


def _checked(fn: Callable[..., object], ok: bool, value: Any) -> float:
    """The reward of a call that returned ``value`` (raised it, when not ``ok``), or ``RewardError``."""
    if not ok:
        raise RewardError(f"reward function {_name(fn)!r} raised {value!r}") from value
    if type(value) is float:  # the common case, checked first
        if value - value == 0.0:  # finite: inf - inf and nan - nan are nan
            return value
        raise RewardError(f"reward function {_name(fn)!r} returned {value}")
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, (int, float)) and not (isinstance(value, torch.Tensor) and value.numel() == 1):
        raise RewardError(f"reward function {_name(fn)!r} returned {type(value).__name__} ({value!r:.80}); it must return a float")
    value = float(value)
    if not math.isfinite(value):
        raise RewardError(f"reward function {_name(fn)!r} returned {value}")
    return value


_TIMED_OUT = object()


def _name(fn: Callable[..., object]) -> str:
    return getattr(fn, "__name__", repr(fn))
