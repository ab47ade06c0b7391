"""The rollout controller: runs workflows concurrently, bounds staleness, hands out batches.

A uvloop event loop runs in a background thread and owns all mutable state
(queues, counters, running tasks); the trainer's thread only ever calls into
it through ``loop.call_soon_threadsafe`` / ``run_coroutine_threadsafe``, so
there are no locks and every public call sees one consistent state.

Flow of one item: ``submit`` puts it in the bounded input queue; the loop
admits it when the staleness bound, the concurrency limit and the output
queue all have room (and the controller is not paused); its workflow runs as
a task; the result is validated and either accepted into the output queue,
rejected (its slot is freed) or recorded as a failure. ``wait`` takes
accepted groups off the output queue and concatenates them into one batch.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import gc
import logging
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine, Iterable, Iterator

import torch
import uvloop
from tensordict import TensorDict

from arealite.api.types import validate_trajectory
from arealite.config.schema import RolloutConfig
from arealite.rollout.staleness import StalenessManager
from arealite.workflow.base import RolloutWorkflow, concat_trajectories, reject_equal_rewards

logger = logging.getLogger("arealite.rollout")

ShouldAccept = Callable[[TensorDict], bool]


class WorkflowError(RuntimeError):
    """A workflow raised (or returned a malformed trajectory) on one item."""

    def __init__(self, item: Any, tb: str):
        self.item = item
        self.traceback = tb
        super().__init__(
            f"workflow failed on item {_short(item)}; rollout.on_workflow_error='fail' stops the run "
            f"(set it to 'drop' to skip such items). Workflow traceback:\n{tb}"
        )


class ControllerStopped(RuntimeError):
    """The controller was used before ``start()`` or after ``stop()``."""


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

    ``world_size``: trainer ranks; this rank's consumer batch is
    ``consumer_batch_size // world_size`` groups.
    """

    def __init__(self, engine: Any, config: RolloutConfig, world_size: int = 1):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if config.consumer_batch_size < world_size:
            raise ValueError(
                f"rollout.consumer_batch_size={config.consumer_batch_size} is smaller than the "
                f"{world_size} trainer ranks; each rank needs at least one group per step"
            )
        self.engine = engine
        self.config = config
        self.world_size = world_size
        self.batch_size = config.consumer_batch_size // world_size
        self.staleness = StalenessManager(
            config.max_concurrent_rollouts, self.batch_size, config.max_head_offpolicyness
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._input: collections.deque[_Job] = collections.deque()
        self._output: collections.deque[tuple[TensorDict, Any]] = collections.deque()
        self._running: dict[int, _Job] = {}
        self._paused = False
        self._version = 0
        self._closing = False  # stop() in progress: nothing new is admitted
        self._old_switch_interval: float | None = None  # restored by stop()
        self._error: WorkflowError | None = None
        # wait() callers parked on the loop: (future, groups wanted). Woken only when
        # they may be able to return (not on every finished episode).
        self._waiters: list[tuple[asyncio.Future, int]] = []
        self._counters = {"submitted": 0, "accepted": 0, "rejected": 0, "failed": 0, "consumed": 0}
        self._staleness_hist: collections.Counter[int] = collections.Counter()
        self._workflows: dict[int, RolloutWorkflow] = {}
        self._data_iters: dict[int, Iterator] = {}
        self._resubmit: list[Any] = []  # restored unfinished items (already counted as submitted)
        self._unsubmitted: list[Any] = []  # pulled from the dataloader, not yet submitted
        self._next_id = 0
        # Per-prompt accounting (arealite.utils.accounting): items of the last batch taken,
        # and, when ``record_dropped`` is set, items rejected/failed since the last ``take_dropped()``.
        self.last_batch_items: list[Any] = []
        self.record_dropped = False
        self._dropped: list[Any] = []

    # ------------------------------------------------------------ lifecycle
    def start(self, init_timeout: float = 300.0) -> "RolloutController":
        """Start the event loop thread; initialise the engine on it (if it has ``initialize``)."""
        if self._thread is not None:
            raise RuntimeError("controller already started")
        if self.config.gil_switch_interval_ms is not None:
            self._old_switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(self.config.gil_switch_interval_ms / 1000)
        if self.config.freeze_gc:
            # A trainer process holds ~10^5-10^6 long-lived objects; without this, every
            # full collection triggered by the rollout's allocations scans them all.
            gc.collect()
            gc.freeze()
        self._loop = uvloop.new_event_loop()
        ready = threading.Event()

        def _main() -> None:
            # One intra-op thread on this thread only (the setting is per thread): the loop
            # builds small tensors, and a torch op that goes parallel here leaves an OpenMP
            # worker spin-waiting after it, which cost ~90 us of CPU per trajectory, taken
            # from the servers and the trainer on a small machine.
            torch.set_num_threads(1)
            asyncio.set_event_loop(self._loop)
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=_main, name="arealite-rollout", daemon=True)
        self._thread.start()
        ready.wait()
        init = getattr(self.engine, "initialize", None)
        if init is not None:
            try:
                self.run(init(timeout=init_timeout), timeout=init_timeout + 30)
            except TypeError:  # an engine whose initialize takes no timeout
                self.run(init(), timeout=init_timeout + 30)
            except BaseException:
                self.stop()
                raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel running episodes, close the engine, stop and join the loop thread."""
        if self._thread is None or self._loop is None:
            return

        async def _shutdown() -> None:
            # First stop admission: an episode finishing while the others are being
            # cancelled would otherwise admit a new one that nobody cancels, and it
            # would fail against the closed HTTP session.
            self._closing = True
            tasks = [j.task for j in self._running.values() if j.task is not None]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            close = getattr(self.engine, "aclose", None)
            if close is not None:
                await close()
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        try:
            if self._loop.is_running():
                asyncio.run_coroutine_threadsafe(_shutdown(), self._loop).result(timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._loop.close()
            # Jobs that never finished stay known, so that state_dict() after stop still lists them.
            self._input.extendleft(reversed(list(self._running.values())))
            self._running.clear()
            self.staleness.running = 0
            self._thread = None
            self._loop = None
            self._closing = False
            if self._old_switch_interval is not None:
                sys.setswitchinterval(self._old_switch_interval)
                self._old_switch_interval = None

    def __enter__(self) -> "RolloutController":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------ thread plumbing
    def run(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Run a coroutine on the controller's loop from the trainer's thread and return its result."""
        if self._loop is None:
            coro.close()
            raise ControllerStopped("controller is not running: call start() first")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("run() was called from the controller's own loop; await the coroutine instead")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            if fut.done():  # the coroutine itself raised TimeoutError (same class since 3.11)
                raise
            fut.cancel()
            raise TimeoutError(f"coroutine did not finish within {timeout}s") from None
        except BaseException:  # Ctrl-C in the trainer thread: do not leave the coroutine running
            fut.cancel()
            raise

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a plain function on the loop thread (atomically with respect to the loop)."""

        async def _wrap() -> Any:
            return fn(*args)

        return self.run(_wrap())

    # ------------------------------------------------------------ admission
    def submit(self, item: Any, workflow: RolloutWorkflow, should_accept: ShouldAccept | None = None) -> None:
        """Queue one item (one group) for ``workflow``; raise ``queue.Full``-like error if the input queue is full."""
        if not hasattr(workflow, "arun_episode"):
            raise TypeError(f"workflow must have an async arun_episode(engine, item), got {type(workflow).__name__}")
        self._call(self._submit_on_loop, _Job(item, workflow, should_accept), True)

    def _submit_on_loop(self, job: _Job, count: bool) -> None:
        if len(self._input) >= self.config.queue_size:
            raise InputQueueFull(
                f"input queue is full ({self.config.queue_size} items, rollout.queue_size); "
                "consume with wait() first or raise rollout.queue_size"
            )
        self._input.append(job)
        self._workflows.setdefault(id(job.workflow), job.workflow)
        if count:
            self._counters["submitted"] += 1
        self._admit()

    def _submit_many_on_loop(self, jobs: list[_Job]) -> None:
        if len(self._input) + len(jobs) > self.config.queue_size:
            raise InputQueueFull(f"input queue cannot take {len(jobs)} more items (rollout.queue_size={self.config.queue_size})")
        for job in jobs:
            self._input.append(job)
            self._workflows.setdefault(id(job.workflow), job.workflow)
        self._counters["submitted"] += len(jobs)
        self._admit()

    def _capacity(self) -> int:
        if self._paused or self._closing:
            return 0
        # Back-pressure: finished + running groups never exceed the output queue.
        by_output = self.config.queue_size - (len(self._output) + len(self._running))
        return max(0, min(self.staleness.capacity(), by_output))

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
        if not self._waiters:
            return
        wake_all = force or self._error is not None or not self._running
        ready = len(self._output)
        for fut, want in self._waiters:
            if not fut.done() and (wake_all or ready >= want):
                fut.set_result(None)

    async def _run_job(self, jid: int, job: _Job) -> None:
        try:
            td = await job.workflow.arun_episode(self.engine, job.item)
            if td is not None:
                validate_trajectory(td, where=f"workflow {type(job.workflow).__name__}")
            accept = td is not None and (job.should_accept is None or bool(job.should_accept(td)))
        except asyncio.CancelledError:
            raise  # stop(): the job stays listed as unfinished
        except Exception:
            self._running.pop(jid, None)
            self.staleness.on_reject()
            if self.record_dropped:
                self._dropped.append(job.item)
            self._on_failure(job.item, traceback.format_exc())
        else:
            self._running.pop(jid, None)
            if accept:
                self.staleness.on_accept()
                self._counters["accepted"] += 1
                self._output.append((td, job.item))
            else:
                self.staleness.on_reject()
                self._counters["rejected"] += 1
                if self.record_dropped:
                    self._dropped.append(job.item)
        self._admit()

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
        while True:
            self._raise_error()
            if should_accept is not None:
                self._filter_output(should_accept)
            if len(self._output) >= count:
                return self._take(count)
            if not self._running and not self._paused:
                self._raise_stuck(count)
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(
                    f"wait({count}) timed out after {timeout}s with {len(self._output)} groups ready, "
                    f"{len(self._running)} running, {len(self._input)} queued"
                    + (" (controller is paused)" if self._paused else "")
                )
            fut = self._loop.create_future()
            entry = (fut, count)
            self._waiters.append(entry)
            timer = None if remaining is None else self._loop.call_later(
                remaining, lambda: fut.done() or fut.set_result(None)
            )
            try:
                await fut
            finally:
                self._waiters.remove(entry)
                if timer is not None:
                    timer.cancel()

    def _raise_stuck(self, count: int) -> None:
        """Nothing runs and nothing can be admitted: waiting would hang forever, so say why."""
        sm = self.staleness
        if self._input:
            raise RuntimeError(
                f"wait({count}) can never complete: {len(self._output)} groups ready, none running, "
                f"{len(self._input)} queued but the staleness limit is reached (accepted={sm.accepted} >= "
                f"(eta={sm.max_head_offpolicyness} + version={sm.version} + 1) * batch={sm.consumer_batch_size}); "
                "call set_version() after every training step"
            )
        raise RuntimeError(
            f"wait({count}) can never complete: {len(self._output)} groups ready, none running or queued; "
            f"submit more items (rejected so far: {self._counters['rejected']}, failed: {self._counters['failed']})"
        )

    def _raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _filter_output(self, should_accept: ShouldAccept) -> None:
        kept: collections.deque = collections.deque()
        dropped = 0
        for td, item in self._output:
            if should_accept(td):
                kept.append((td, item))
            else:
                dropped += 1
                if self.record_dropped:
                    self._dropped.append(item)
        if dropped:
            self._output = kept
            self.staleness.on_unaccept(dropped)
            self._counters["accepted"] -= dropped
            self._counters["rejected"] += dropped
            self._admit()

    def _take(self, count: int) -> TensorDict:
        taken = [self._output.popleft() for _ in range(count)]
        tds = [td for td, _ in taken]
        self.last_batch_items = [item for _, item in taken]
        self._counters["consumed"] += count
        self._admit()
        batch = concat_trajectories(tds)
        # Staleness of each trajectory: trainer version minus the oldest version among its tokens.
        none = torch.iinfo(torch.int64).max
        oldest = batch["versions"].masked_fill(~batch["loss_mask"], none).min(dim=1).values
        self._staleness_hist.update(self.staleness.version - v for v in oldest.tolist() if v != none)
        return batch

    def rollout_batch(self, items: list[Any], workflow: RolloutWorkflow, should_accept: ShouldAccept | None = None) -> TensorDict:
        """Submit ``items`` and wait for all of them (evaluation, tests); the order of rows is completion order."""
        for item in items:
            self.submit(item, workflow, should_accept)
        return self.wait(len(items))

    def prepare_batch(self, dataloader: Iterable, workflow: RolloutWorkflow, should_accept: ShouldAccept | None = None,
                      poll_s: float = 0.05) -> TensorDict:
        """One training batch (``consumer_batch_size // world_size`` groups), keeping the pipeline full.

        Items are pulled from ``dataloader`` (an iterable of lists of items,
        restarted for a new epoch when exhausted) whenever the bound leaves
        room, so the next step's groups are already generating while the
        trainer trains on this one. Items restored by ``load_state_dict`` go first.

        The whole call is one coroutine on the controller's loop (the
        dataloader is iterated there too, so it must be cheap to iterate, as
        in-memory loaders are): a trainer thread that hops to the loop once
        per batch, not once per data batch, is never the bottleneck (each
        hop can cost a GIL switch interval while the loop is busy). Every
        ``poll_s`` seconds without a batch, the input queue is topped up again
        (rejected groups free slots that new items must fill).
        """
        if should_accept is None and self.config.filter_equal_rewards:
            should_accept = reject_equal_rewards
        return self.run(self._prepare_on_loop(dataloader, workflow, should_accept, poll_s))

    async def _prepare_on_loop(self, dataloader: Iterable, workflow: RolloutWorkflow,
                               should_accept: ShouldAccept | None, poll_s: float) -> TensorDict:
        while True:
            if self._resubmit or self._unsubmitted:
                self._drain_resubmit_on_loop(workflow, should_accept)
            self._top_up_on_loop(dataloader, workflow, should_accept)
            try:
                batch = await self._wait_on_loop(self.batch_size, poll_s, None)
            except TimeoutError:
                continue
            # Refill at once, so that the next step's groups generate while this one trains.
            self._top_up_on_loop(dataloader, workflow, should_accept)
            return batch

    def _top_up_on_loop(self, dataloader: Iterable, workflow: RolloutWorkflow,
                        should_accept: ShouldAccept | None) -> None:
        # Keep enough queued that every slot the bound allows is used, and one batch more.
        while len(self._input) < self._capacity() + self.batch_size:
            batch = self._next_data(dataloader)
            if len(self._input) + len(batch) > self.config.queue_size:
                self._unsubmitted.extend(batch)  # do not lose it: it goes first next time
                return
            self._submit_many_on_loop([_Job(it, workflow, should_accept) for it in batch])

    def _next_data(self, dataloader: Iterable) -> list[Any]:
        key = id(dataloader)
        for _ in range(2):
            it = self._data_iters.get(key)
            if it is None:
                it = self._data_iters[key] = iter(dataloader)
            try:
                batch = next(it)
                if not isinstance(batch, (list, tuple)):
                    raise TypeError(f"the dataloader must yield lists of items, got {type(batch).__name__}")
                return list(batch)
            except StopIteration:
                self._data_iters.pop(key, None)  # a new epoch
        raise ValueError("the dataloader yields no batch at all (empty dataset, or drop_last with too few items)")

    def _drain_resubmit(self, workflow: RolloutWorkflow, should_accept: ShouldAccept | None) -> None:
        self._call(self._drain_resubmit_on_loop, workflow, should_accept)

    def _drain_resubmit_on_loop(self, workflow: RolloutWorkflow, should_accept: ShouldAccept | None) -> None:
        # Restored items were counted as submitted before the restart; overflow items were not.
        for pending, counted in ((self._resubmit, False), (self._unsubmitted, True)):
            while pending:
                if len(self._input) >= self.config.queue_size:
                    return
                self._submit_on_loop(_Job(pending.pop(0), workflow, should_accept), counted)

    # --------------------------------------------------------------- admin
    def pause(self) -> None:
        """Stop admitting new episodes (running ones go on); used around weight updates."""
        self._call(self._set_paused, True)

    def resume(self) -> None:
        """Admit episodes again."""
        self._call(self._set_paused, False)

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
                staleness_hist=dict(sorted(self._staleness_hist.items())),
            )
            for wf in self._workflows.values():
                for k, v in wf.stats().items():
                    key = f"workflow/{k}"
                    out[key] = out.get(key, 0) + v
            return out

        return self._call(_snap) if self._loop is not None else _snap()

    # ------------------------------------------------------------ recovery
    def state_dict(self) -> dict[str, Any]:
        """Version, counters, produced-but-unconsumed groups and unfinished items (to resubmit)."""
        def _snap() -> dict[str, Any]:
            pending = [j.item for j in self._running.values()] + [j.item for j in self._input] + list(self._resubmit)
            
            return {
                "staleness": self.staleness.state_dict(),
                "counters": dict(self._counters),
                "staleness_hist": dict(self._staleness_hist),
                "ready": [(td.to_dict(), item) for td, item in self._output],
                "pending_items": pending,
                "unsubmitted_items": list(self._unsubmitted),
                "dropped_items": list(self._dropped),
            }

        return self._call(_snap) if self._loop is not None else _snap()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict``; call before ``start()``.

        Ready groups go back to the output queue; unfinished items are
        resubmitted by the next ``prepare_batch`` (with its workflow) or by
        ``resubmit_pending(workflow)``, without counting as new submissions.
        """
        if self._thread is not None:
            raise RuntimeError("load_state_dict() must be called before start()")
        self.staleness.load_state_dict(state["staleness"])
        self._version = self.staleness.version
        self._counters.update({k: int(v) for k, v in state["counters"].items()})
        self._staleness_hist = collections.Counter({int(k): int(v) for k, v in state["staleness_hist"].items()})
        self._output = collections.deque()
        for d, item in state["ready"]:
            td = TensorDict(d, batch_size=[d["input_ids"].shape[0]])
            self._output.append((td, item))
        self._resubmit = list(state["pending_items"])
        self._unsubmitted = list(state.get("unsubmitted_items", []))
        self._dropped = list(state.get("dropped_items", []))

    def take_dropped(self) -> list[Any]:
        """Items rejected or failed since the last call (they will not be trained on)."""
        def _take() -> list[Any]:
            out, self._dropped = self._dropped, []
            return out

        return self._call(_take) if self._loop is not None else _take()

    def resubmit_pending(self, workflow: RolloutWorkflow, should_accept: ShouldAccept | None = None) -> int:
        """Resubmit the unfinished items restored by ``load_state_dict``; returns how many."""
        n = len(self._resubmit) + len(self._unsubmitted)
        self._drain_resubmit(workflow, should_accept)
        return n - len(self._resubmit) - len(self._unsubmitted)


class InputQueueFull(RuntimeError):
    """``submit`` found the bounded input queue full."""
