"""The rollout controller: runs workflows concurrently, bounds staleness, hands out batches.

A uvloop event loop runs in a background thread (``LoopThread``) and owns all
mutable state (queues, counters, running tasks); the trainer's thread only ever
calls into it through ``loop.call_soon_threadsafe`` / ``run_coroutine_threadsafe``,
so there are no locks and every public call sees one consistent state.

Flow of one item: ``submit`` puts it in the bounded input queue; the loop
admits it when the staleness bound, the concurrency limit and the output
queue all have room (and the controller is not paused); its workflow runs as
a task; the result is validated and either accepted into the output queue
(``ReadyGroups``), rejected (its slot is freed) or recorded as a failure.
``wait`` takes accepted groups off the output queue as one batch.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine, Iterable

from tensordict import TensorDict

from arealite.api.contracts import InferenceClient
from arealite.api.types import validate_trajectory
from arealite.config.schema import RolloutConfig
from arealite.rollout.dropped import DroppedItems
from arealite.rollout.feed import DataFeed, ShouldAccept
from arealite.rollout.loop_thread import (
    ControllerStopped,
    LoopThread,
    cancel_other_tasks,
    restore_switch_interval,
    tune_process,
)
from arealite.rollout.ready import ReadyGroups, Waiters
from arealite.rollout.recovery import controller_state, restore_controller
from arealite.rollout.staleness import StalenessManager
from arealite.workflow.base import RolloutWorkflow, reject_equal_rewards

__all__ = ["ControllerStopped", "InputQueueFull", "RolloutController", "ShouldAccept", "WorkflowError"]

logger = logging.getLogger("arealite.rollout")


class WorkflowError(RuntimeError):
    """A workflow raised (or returned a malformed trajectory) on one item."""

    def __init__(self, item: Any, tb: str):
        self.item = item
        self.traceback = tb
        super().__init__(
            f"workflow failed on item {_short(item)}; rollout.on_workflow_error='fail' stops the run "
            f"(set it to 'drop' to skip such items). Workflow traceback:\n{tb}"
        )


def _short(item: Any, n: int = 300) -> str:
    s = repr(item)
    return s if len(s) <= n else s[:n] + "...}"


@dataclass
class _Job:
    item: Any
    workflow: RolloutWorkflow
    should_accept: ShouldAccept | None = None
    task: asyncio.Task | None = field(default=None, repr=False)


class RolloutController:
    """Runs ``RolloutWorkflow``s on a background event loop under the staleness bound.

    ``client``: the inference client workflows generate with (``arealite.api.contracts.InferenceClient``;
    its ``initialize``/``aclose`` run on the controller's loop at start/stop).
    ``world_size``: trainer ranks; this rank's consumer batch is
    ``consumer_batch_size // world_size`` groups.
    """

    def __init__(self, client: InferenceClient, config: RolloutConfig, world_size: int = 1):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if config.consumer_batch_size < world_size:
            raise ValueError(
                f"rollout.consumer_batch_size={config.consumer_batch_size} is smaller than the "
                f"{world_size} trainer ranks; each rank needs at least one group per step"
            )
        self.client = client
        self.config = config
        self.world_size = world_size
        self.batch_size = config.consumer_batch_size // world_size
        self.staleness = StalenessManager(
            config.max_concurrent_rollouts, self.batch_size, config.max_head_offpolicyness
        )
        self._lt = LoopThread("arealite-rollout")
        self._input: collections.deque[_Job] = collections.deque()
        self._output = ReadyGroups()
        self._running: dict[int, _Job] = {}
        self._paused = False
        self._version = 0
        self._closing = False  # stop() in progress: nothing new is admitted
        self._old_switch_interval: float | None = None  # restored by stop()
        self._error: WorkflowError | None = None
        self._waiters = Waiters()
        self._counters = {"submitted": 0, "accepted": 0, "rejected": 0, "failed": 0, "consumed": 0}
        self._workflows: dict[int, RolloutWorkflow] = {}
        self._feed = DataFeed(self)  # prepare_batch's items: restored ones, then the dataloader's
        self._next_id = 0
        # Per-prompt accounting (arealite.utils.accounting): items of the last batch taken,
        # and, when ``record_dropped`` is set, items rejected/failed since the last ``take_dropped()``.
        self.last_batch_items: list[Any] = []
        self.record_dropped = False
        self._dropped = DroppedItems()

    # ------------------------------------------------------------ lifecycle
    def start(self, init_timeout: float = 300.0) -> "RolloutController":
        """Start the event loop thread; initialise the client on it (if it has ``initialize``)."""
        if self._thread is not None:
            raise RuntimeError("controller already started")
        self._old_switch_interval = tune_process(self.config.gil_switch_interval_ms, self.config.freeze_gc)
        self._lt.start()
        init = getattr(self.client, "initialize", None)
        if init is not None:
            try:
                self.run(init(timeout=init_timeout), timeout=init_timeout + 30)
            except TypeError:  # a client whose initialize takes no timeout
                self.run(init(), timeout=init_timeout + 30)
            except BaseException:
                self.stop()
                raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel running episodes, close the client, stop and join the loop thread."""
        if not self._lt.running:
            return
        try:
            self._lt.stop(self._shutdown_on_loop, timeout)
        finally:
            # Jobs that never finished stay known, so that state_dict() after stop still lists them.
            self._input.extendleft(reversed(list(self._running.values())))
            self._running.clear()
            self.staleness.running = 0
            self._closing = False
            self._unstash()  # the loop is gone: nothing else touches the queue now
            restore_switch_interval(self._old_switch_interval)
            self._old_switch_interval = None

    async def _shutdown_on_loop(self) -> None:
        # First stop admission: an episode finishing while the others are being
        # cancelled would otherwise admit a new one that nobody cancels, and it
        # would fail against the closed HTTP session.
        self._closing = True
        tasks = [j.task for j in self._running.values() if j.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        close = getattr(self.client, "aclose", None)
        if close is not None:
            await close()
        await cancel_other_tasks()

    def __enter__(self) -> "RolloutController":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------ thread plumbing
    @property
    def _loop(self) -> asyncio.AbstractEventLoop | None:
        return self._lt.loop

    @property
    def _thread(self) -> threading.Thread | None:
        return self._lt.thread

    def run(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Run a coroutine on the controller's loop from the trainer's thread and return its result."""
        return self._lt.run(coro, timeout)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a plain function on the loop thread (atomically with respect to the loop)."""
        return self._lt.call(fn, *args)

    def _here_or_on_loop(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the loop thread while the loop runs, else in this thread (nothing else touches the state)."""
        return self._call(fn) if self._loop is not None else fn()

    # ------------------------------------------------------------ admission
    def submit(self, item: Any, workflow: RolloutWorkflow, should_accept: ShouldAccept | None = None) -> None:
        """Queue one item (one group) for ``workflow``; raise ``queue.Full``-like error if the input queue is full."""
        if not hasattr(workflow, "arun_episode"):
            raise TypeError(f"workflow must have an async arun_episode(client, item), got {type(workflow).__name__}")
        self._call(self._enqueue_on_loop, [item], workflow, should_accept, True)

    def _enqueue_on_loop(self, items: list[Any], workflow: RolloutWorkflow, should_accept: ShouldAccept | None,
                         counted: bool) -> None:
        """Put ``items`` in the input queue (all or none), then admit what the bound allows."""
        if len(self._input) + len(items) > self.config.queue_size:
            raise InputQueueFull(
                f"input queue cannot take {len(items)} more item(s): it holds {len(self._input)} of "
                f"rollout.queue_size={self.config.queue_size}; consume with wait() first or raise rollout.queue_size"
            )
        self._input.extend(_Job(it, workflow, should_accept) for it in items)
        self._workflows.setdefault(id(workflow), workflow)
        if counted:
            self._counters["submitted"] += len(items)
        self._admit()

    def _capacity(self) -> int:
        if self._paused or self._closing:
            return 0
        # Back-pressure: finished + running groups never exceed the output queue.
        by_output = self.config.queue_size - (len(self._output) + len(self._running))
        cap = min(self.staleness.capacity(), by_output)
        if self._feed.started and self._counters["consumed"] == 0:
            # The first training batch overlaps with nothing: it generates alone, so that the
            # trainer starts as soon as it is done; what the bound lets run ahead follows.
            cap = min(cap, self.batch_size - len(self._output) - len(self._running))
        return max(0, cap)

    def _admit(self) -> None:
        n = min(self._capacity(), len(self._input))
        for _ in range(n):
            job = self._input.popleft()
            self.staleness.on_submit()
            jid = self._next_id
            self._next_id += 1
            self._running[jid] = job
            job.task = self._loop.create_task(self._run_job(jid, job))
        if self._waiters:
            self._notify()

    def _notify(self, force: bool = False) -> None:
        """Wake the wait() callers that can make progress: enough groups, an error, or nothing running."""
        if self._waiters:
            self._waiters.wake(len(self._output), force or self._error is not None or not self._running)

    async def _run_job(self, jid: int, job: _Job) -> None:
        try:
            td = await job.workflow.arun_episode(self.client, job.item)
            if td is not None:
                validate_trajectory(td, where=f"workflow {type(job.workflow).__name__}")
            accept = td is not None and (job.should_accept is None or bool(job.should_accept(td)))
        except asyncio.CancelledError:
            raise  # stop(): the job stays listed as unfinished
        except Exception:
            self._running.pop(jid, None)
            self.staleness.on_reject()
            self._record_dropped([job.item])
            self._on_failure(job.item, traceback.format_exc())
        else:
            self._running.pop(jid, None)
            if accept:
                self.staleness.on_accept()
                self._counters["accepted"] += 1
                self._output.put(td, job.item)
            else:
                self.staleness.on_reject()
                self._counters["rejected"] += 1
                self._record_dropped([job.item])
        self._admit()

    def _record_dropped(self, items: list[Any]) -> None:
        if self.record_dropped:
            self._dropped.extend(items)

    def _on_failure(self, item: Any, tb: str) -> None:
        self._counters["failed"] += 1
        if self.config.on_workflow_error == "drop":
            logger.warning("workflow failed on item %s; dropped (on_workflow_error='drop'):\n%s", _short(item), tb)
        elif self._error is None:
            logger.error("workflow failed on item %s:\n%s", _short(item), tb)
            self._error = WorkflowError(item, tb)

    # -------------------------------------------------------------- results
    def wait(self, count: int, timeout: float | None = None, should_accept: ShouldAccept | None = None) -> TensorDict:
        """Block until ``count`` accepted groups are ready; return them as one right-padded batch.

        Raises ``TimeoutError`` after ``timeout`` seconds (nothing is lost: the
        groups stay queued for the next call) and ``WorkflowError`` if a
        workflow failed under ``on_workflow_error='fail'``. ``should_accept``
        filters queued groups; a group it refuses counts as rejected.
        """
        if count < 1:
            raise ValueError(f"wait(count) needs count >= 1, got {count}")
        if count > self.config.queue_size:
            raise ValueError(
                f"wait(count={count}) can never be satisfied: at most rollout.queue_size="
                f"{self.config.queue_size} groups are ever queued"
            )
        return self.run(self._wait_on_loop(count, timeout, should_accept))

    async def _wait_on_loop(self, count: int, timeout: float | None, should_accept: ShouldAccept | None) -> TensorDict:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._unstash()  # groups are handed out in completion order
        while True:
            self._raise_error()
            if should_accept is not None:
                self._filter_output(should_accept)
            if len(self._output) >= count:
                return self._take(count)
            if not self._running and not self._paused:
                raise _stuck_error(count, len(self._output), len(self._input), self.staleness, self._counters)
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(
                    f"wait({count}) timed out after {timeout}s with {len(self._output)} groups ready, "
                    f"{len(self._running)} running, {len(self._input)} queued"
                    + (" (controller is paused)" if self._paused else "")
                )
            await self._waiters.park(self._loop, count, remaining)

    def _raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _filter_output(self, should_accept: ShouldAccept) -> None:
        dropped = self._output.filter(should_accept)
        if dropped:
            self._record_dropped(dropped)
            self.staleness.on_unaccept(len(dropped))
            self._counters["accepted"] -= len(dropped)
            self._counters["rejected"] += len(dropped)
            self._admit()

    def _take(self, count: int) -> TensorDict:
        batch, self.last_batch_items = self._output.take(count, self.staleness.version)
        self._counters["consumed"] += count
        self._admit()
        return batch

    def rollout_batch(self, items: list[Any], workflow: RolloutWorkflow, should_accept: ShouldAccept | None = None) -> TensorDict:
        """Submit ``items`` and wait for all of them (evaluation, tests); the order of rows is completion order."""
        for item in items:
            self.submit(item, workflow, should_accept)
        return self.wait(len(items))

    def prepare_batch(self, dataloader: Iterable, workflow: RolloutWorkflow, should_accept: ShouldAccept | None = None,
                      poll_s: float = 0.05) -> TensorDict:
        """One training batch (``consumer_batch_size // world_size`` groups), keeping the pipeline full.

        Items are pulled from ``dataloader`` (lists of items, restarted for a new epoch)
        whenever the bound leaves room, so the next step's groups generate while the trainer
        trains on this one; restored items go first (``arealite.rollout.feed``). One
        coroutine on the loop (the dataloader is iterated there: it must be cheap to
        iterate), or none when `resume` took the batch ahead. Every ``poll_s`` seconds
        without a batch, the input queue is topped up again (rejections free slots).
        """
        if should_accept is None and self.config.filter_equal_rewards:
            should_accept = reject_equal_rewards
        if should_accept is None:
            stashed = self._output.take_stashed()
            if stashed is not None:
                batch, self.last_batch_items = stashed
                return batch
        return self.run(self._feed.prepare(dataloader, workflow, should_accept, poll_s))

    # --------------------------------------------------------------- admin
    def pause(self) -> None:
        """Stop admitting new episodes (running ones go on); used around weight updates."""
        self._call(self._set_paused, True)

    def resume(self, prefetch: tuple[Iterable, RolloutWorkflow] | None = None) -> None:
        """Admit episodes again, without waiting for the loop (like `set_version`): the
        burst of launches it sets off is none of the trainer's business.

        ``prefetch``: the ``(dataloader, workflow)`` of `prepare_batch`. When a whole batch
        is ready, the loop takes it before it launches anything, and the next
        `prepare_batch` returns it without a trip to the then busy loop (`ReadyGroups.stash`).
        """
        loop = self._loop
        if loop is None:
            self._call(self._set_paused, False)  # raises ControllerStopped, as pause() does
        else:
            self._paused = False  # seen at once by `paused`; the loop admits on its next turn
            loop.call_soon_threadsafe(self._resume_on_loop, prefetch)

    def _resume_on_loop(self, prefetch: tuple[Iterable, RolloutWorkflow] | None) -> None:
        if (prefetch is not None and self._error is None and not self.config.filter_equal_rewards
                and not self._output.stashed and not len(self._feed) and len(self._output) >= self.batch_size):
            self._output.stash(self.batch_size, self.staleness.version)
            self._counters["consumed"] += self.batch_size
            self._feed.top_up(*prefetch, None)  # as prepare_batch refills after a take
        self._set_paused(False)

    def _unstash(self) -> None:
        """A batch taken ahead and not handed out goes back in front (on the loop)."""
        self._counters["consumed"] -= self._output.unstash()

    def _set_paused(self, paused: bool) -> None:
        self._paused = paused
        self._admit()
        self._notify(force=True)  # waiters re-check the stuck and paused conditions

    @property
    def paused(self) -> bool:
        return self._paused

    def set_version(self, version: int) -> None:
        """The trainer's policy version (raises the staleness limit by one batch per version).

        Does not wait for the loop (a round trip there can cost a GIL switch
        interval); the loop applies it before any later call to the controller.
        """
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        self._version = version
        if self._loop is None:
            self.staleness.set_version(version)
        else:
            self._loop.call_soon_threadsafe(self._set_version_on_loop, version)

    def _set_version_on_loop(self, version: int) -> None:
        self.staleness.set_version(version)
        self._admit()

    def get_version(self) -> int:
        """The version last given to ``set_version`` (or restored by ``load_state_dict``)."""
        return self._version

    # --------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        """Counters, queue depths, staleness histogram and workflow counters (reward errors...)."""
        def _snap() -> dict[str, Any]:
            out: dict[str, Any] = dict(self._counters)
            out.update(
                running=len(self._running),
                input_queue=len(self._input),
                output_queue=len(self._output),
                version=self.staleness.version,
                capacity=self._capacity(),
                paused=self._paused,
                staleness_hist=dict(sorted(self._output.staleness_hist.items())),
            )
            for wf in self._workflows.values():
                for k, v in wf.stats().items():
                    out[f"workflow/{k}"] = out.get(f"workflow/{k}", 0) + v
            return out

        return self._here_or_on_loop(_snap)

    # ------------------------------------------------------------ recovery
    def state_dict(self) -> dict[str, Any]:
        """Version, counters, produced-but-unconsumed groups and unfinished items (to resubmit)."""
        return self._here_or_on_loop(lambda: controller_state(self))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict``; call before ``start()``.

        Ready groups go back to the output queue; unfinished items are
        resubmitted by the next ``prepare_batch`` (with its workflow) or by
        ``resubmit_pending(workflow)``, without counting as new submissions.
        """
        if self._thread is not None:
            raise RuntimeError("load_state_dict() must be called before start()")
        restore_controller(self, state)

    def take_dropped(self) -> list[Any]:
        """Items rejected or failed since the last call (they will not be trained on); from
        any thread, without waiting for the loop (`DroppedItems`)."""
        return self._dropped.take()

    def resubmit_pending(self, workflow: RolloutWorkflow, should_accept: ShouldAccept | None = None) -> int:
        """Resubmit the unfinished items restored by ``load_state_dict``; returns how many."""
        n = len(self._feed)
        self._call(self._feed.drain, workflow, should_accept)
        return n - len(self._feed)


class InputQueueFull(RuntimeError):
    """``submit`` found the bounded input queue full."""


def _stuck_error(count: int, ready: int, queued: int, sm: StalenessManager, counters: dict[str, int]) -> RuntimeError:
    """Why ``wait(count)`` would hang forever: nothing runs and nothing can be admitted."""
    if queued:
        return RuntimeError(
            f"wait({count}) can never complete: {ready} groups ready, none running, "
            f"{queued} queued but the staleness limit is reached (accepted={sm.accepted} >= "
            f"(eta={sm.max_head_offpolicyness} + version={sm.version} + 1) * batch={sm.consumer_batch_size}); "
            "call set_version() after every training step"
        )
    return RuntimeError(
        f"wait({count}) can never complete: {ready} groups ready, none running or queued; "
        f"submit more items (rejected so far: {counters['rejected']}, failed: {counters['failed']})"
    )
