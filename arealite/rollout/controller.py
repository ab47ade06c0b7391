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

The controller composes its parts, each with its own state: `Admission` (the input
queue, the running episodes and their outcomes), `DataFeed` (items in from the
dataloader, batches out), `ReadyGroups` (the output queue), `StalenessManager` (the
bound), `RolloutLedger` (counters, version, restored items) and `DroppedItems`.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Coroutine, TypeVar

from tensordict import TensorDict

from arealite.api.contracts import InferenceClient
from arealite.config.schema import RolloutConfig
from arealite.rollout.admission import Admission, InputQueueFull, ShouldAccept, WorkflowError
from arealite.rollout.dropped import DroppedItems
from arealite.rollout.feed import DataFeed, ItemBatches
from arealite.rollout.ledger import RolloutLedger
from arealite.rollout.loop_thread import (
    ControllerStopped,
    LoopThread,
    ProcessSettings,
    cancel_other_tasks,
    restore_process,
    tune_process,
)
from arealite.rollout.ready import ReadyGroups, ReadyState
from arealite.rollout.staleness import StalenessManager
from arealite.utils.json_types import JsonObject
from arealite.workflow.base import RolloutWorkflow, reject_equal_rewards

__all__ = ["ControllerState", "ControllerStopped", "InputQueueFull", "RolloutController", "ShouldAccept",
           "WorkflowError"]

T = TypeVar("T")


class _SavedAlways(ReadyState):
    staleness: dict[str, int]
    counters: dict[str, int]
    pending_items: list[JsonObject]


class ControllerState(_SavedAlways, total=False):
    """What a checkpoint keeps of a controller (`RolloutController.state_dict`); the last two
    keys are absent from checkpoints older than them."""

    unsubmitted_items: list[JsonObject]
    dropped_items: list[JsonObject]


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
        self._client = client
        self.config = config
        self.world_size = world_size
        self.batch_size = config.consumer_batch_size // world_size
        self.staleness = StalenessManager(
            config.max_concurrent_rollouts, self.batch_size, config.max_head_offpolicyness
        )
        self._lt = LoopThread("arealite-rollout")
        self._old_settings: ProcessSettings | None = None  # restored by stop()
        self._ready = ReadyGroups()
        self._ledger = RolloutLedger()
        # Per-prompt accounting (arealite.utils.accounting): when ``record_dropped`` is set,
        # items rejected/failed since the last ``take_dropped()``.
        self._dropped = DroppedItems()
        self._admission = Admission(client, config, self.batch_size, self._lt, self.staleness,
                                    self._ready, self._ledger, self._dropped)
        # prepare_batch's items (restored ones, then the dataloader's) and every batch handed out
        self._feed = DataFeed(self._admission, self._ready, self.staleness, self._ledger, self._dropped,
                              self.batch_size)

    @property
    def client(self) -> InferenceClient:
        """The inference client workflows generate with (fixed at construction)."""
        return self._client

    # ------------------------------------------------------------ lifecycle
    def start(self, init_timeout: float = 300.0) -> "RolloutController":
        """Start the event loop thread; initialise the client on it (if it has ``initialize``)."""
        if self._thread is not None:
            raise RuntimeError("controller already started")
        self._old_settings = tune_process(self.config.gil_switch_interval_ms, self.config.freeze_gc,
                                          self.config.gc_young_threshold)
        self._lt.start()
        init = getattr(self._client, "initialize", None)
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
            # Episodes that never finished stay known, so that state_dict() after stop still lists them.
            self._admission.requeue_unfinished()
            self._feed.unstash()  # the loop is gone: nothing else touches the queue now
            restore_process(self._old_settings)
            self._old_settings = None

    async def _shutdown_on_loop(self) -> None:
        await self._admission.cancel_all()
        close = getattr(self._client, "aclose", None)
        if close is not None:
            await close()
        await cancel_other_tasks()

    def __enter__(self) -> "RolloutController":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------ thread plumbing
    @property
    def _loop(self) -> asyncio.AbstractEventLoop | None:
        return self._lt.loop

    @property
    def _thread(self) -> threading.Thread | None:
        return self._lt.thread

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the controller's loop from the trainer's thread and return its result."""
        return self._lt.run(coro, timeout)

    def _call(self, fn: Callable[..., T], *args: object) -> T:
        """Run a plain function on the loop thread (atomically with respect to the loop)."""
        return self._lt.call(fn, *args)

    def _here_or_on_loop(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the loop thread while the loop runs, else in this thread (nothing else touches the state)."""
        return self._call(fn) if self._loop is not None else fn()

    # ------------------------------------------------------------ admission
    def submit(self, item: JsonObject, workflow: RolloutWorkflow, should_accept: ShouldAccept | None = None) -> None:
        """Queue one item (one group) for ``workflow``; raise ``InputQueueFull`` if the input queue is full."""
        if not hasattr(workflow, "arun_episode"):
            raise TypeError(f"workflow must have an async arun_episode(client, item), got {type(workflow).__name__}")
        self._call(self._admission.enqueue, [item], workflow, should_accept, True)

    def resubmit_pending(self, workflow: RolloutWorkflow, should_accept: ShouldAccept | None = None) -> int:
        """Resubmit the unfinished items restored by ``load_state_dict``; returns how many."""
        n = self._feed.pending
        self._call(self._feed.drain, workflow, should_accept)
        return n - self._feed.pending

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
        return self.run(self._feed.wait(count, timeout, should_accept))

    def rollout_batch(self, items: list[JsonObject], workflow: RolloutWorkflow,
                      should_accept: ShouldAccept | None = None) -> TensorDict:
        """Submit ``items`` and wait for all of them (evaluation, tests); the order of rows is completion order."""
        for item in items:
            self.submit(item, workflow, should_accept)
        return self.wait(len(items))

    def prepare_batch(self, dataloader: ItemBatches, workflow: RolloutWorkflow,
                      should_accept: ShouldAccept | None = None, poll_s: float = 0.05) -> TensorDict:
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
            batch = self._feed.take_stashed()
            if batch is not None:
                return batch
        return self.run(self._feed.prepare(dataloader, workflow, should_accept, poll_s))

    @property
    def last_batch_items(self) -> list[JsonObject]:
        """The items of the last batch handed out (per-prompt accounting)."""
        return self._feed.last_batch_items

    @property
    def record_dropped(self) -> bool:
        """Whether items rejected or failed are kept for `take_dropped` (off by default)."""
        return self._dropped.recording

    @record_dropped.setter
    def record_dropped(self, on: bool) -> None:
        self._dropped.recording = on

    def take_dropped(self) -> list[JsonObject]:
        """Items rejected or failed since the last call (they will not be trained on); from
        any thread, without waiting for the loop (`DroppedItems`)."""
        return self._dropped.take()

    # --------------------------------------------------------------- admin
    def pause(self) -> None:
        """Stop admitting new episodes (running ones go on); used around weight updates."""
        self._call(self._admission.set_paused, True)

    def resume(self, prefetch: tuple[ItemBatches, RolloutWorkflow] | None = None) -> None:
        """Admit episodes again, without waiting for the loop (like `set_version`): the
        burst of launches it sets off is none of the trainer's business.

        ``prefetch``: the ``(dataloader, workflow)`` of `prepare_batch`. When a whole batch
        is ready, the loop takes it before it launches anything, and the next
        `prepare_batch` returns it without a trip to the then busy loop (`ReadyGroups.stash`).
        """
        loop = self._loop
        if loop is None:
            self._call(self._admission.set_paused, False)  # raises ControllerStopped, as pause() does
        else:
            self._admission.paused = False  # seen at once by `paused`; the loop admits on its next turn
            loop.call_soon_threadsafe(self._resume_on_loop, prefetch)

    def _resume_on_loop(self, prefetch: tuple[ItemBatches, RolloutWorkflow] | None) -> None:
        if prefetch is not None:
            self._feed.take_ahead(*prefetch)
        self._admission.set_paused(False)

    @property
    def paused(self) -> bool:
        return self._admission.paused

    def set_version(self, version: int) -> None:
        """The trainer's policy version (raises the staleness limit by one batch per version).

        Does not wait for the loop (a round trip there can cost a GIL switch
        interval); the loop applies it before any later call to the controller.
        """
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        self._ledger.version = version
        if self._loop is None:
            self.staleness.set_version(version)
        else:
            self._loop.call_soon_threadsafe(self._set_version_on_loop, version)

    def _set_version_on_loop(self, version: int) -> None:
        self.staleness.set_version(version)
        self._admission.admit()

    def get_version(self) -> int:
        """The version last given to ``set_version`` (or restored by ``load_state_dict``)."""
        return self._ledger.version

    # --------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        """Counters, queue depths, staleness histogram and workflow counters (reward errors...)."""
        def _snap() -> dict[str, Any]:
            adm = self._admission
            return {
                **self._ledger.counts(),
                "running": adm.running,
                "input_queue": adm.queued,
                "output_queue": len(self._ready),
                "version": self.staleness.version,
                "capacity": adm.capacity(),
                "paused": adm.paused,
                "overdue_wait_s": self._feed.overdue_wait_s,
                "staleness_hist": dict(sorted(self._ready.staleness_hist.items())),
                **adm.workflow_stats(),
            }

        return self._here_or_on_loop(_snap)

    # ----------------------------------------------------------- checkpoint
    def state_dict(self) -> ControllerState:
        """What a checkpoint keeps: the staleness state and counters, the groups produced but not
        trained on yet (ready, with a batch taken ahead put back in front), the items still
        running or queued and those restored but not resubmitted (``pending_items``:
        resubmitted after a restart, not counted as new submissions), the dataloader items
        pulled but not queued, and the dropped items not yet handed to the trainer."""
        def _state() -> ControllerState:
            self._feed.unstash()  # not trained on yet: saved as ready
            return {
                "staleness": self.staleness.state_dict(),
                "counters": self._ledger.counts(),
                **self._ready.state_dict(),  # ready, staleness_hist
                "pending_items": self._admission.unfinished_items() + self._ledger.restored_items(),
                "unsubmitted_items": self._feed.leftover_items(),
                "dropped_items": self._dropped.snapshot(),
            }

        return self._here_or_on_loop(_state)

    def load_state_dict(self, state: ControllerState) -> None:
        """Restore a ``state_dict``; call before ``start()``.

        Ready groups go back to the output queue; unfinished items are
        resubmitted by the next ``prepare_batch`` (with its workflow) or by
        ``resubmit_pending(workflow)``, without counting as new submissions.
        """
        if self._thread is not None:
            raise RuntimeError("load_state_dict() must be called before start()")
        self.staleness.load_state_dict(state["staleness"])
        self._ledger.restore(state["counters"], self.staleness.version, state["pending_items"])
        self._ready.load_state_dict(state)
        self._feed.restore_leftover(state.get("unsubmitted_items", []))
        self._dropped.restore(state.get("dropped_items", []))
