"""Admission: which queued items start their episode, and what becomes of each episode.

Items wait in a bounded input queue; they are admitted, in order, while the staleness
bound, the concurrency limit and the output queue all leave room (and the controller is
neither paused nor stopping). Each admitted item runs its workflow as a task on the
controller's loop; the trajectory group it returns is validated and either accepted into
the ready groups, rejected (its slot is freed) or, when the workflow raised, recorded as a
failure. Every change that could let a ``wait()`` caller return wakes it.

An `Admission` belongs to one controller and runs on its event loop only.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import traceback
from dataclasses import dataclass, field
from typing import Callable

from tensordict import TensorDict

from arealite.api.contracts import InferenceClient
from arealite.api.types import validate_trajectory
from arealite.config.schema import RolloutConfig
from arealite.rollout.dropped import DroppedItems
from arealite.rollout.ledger import RolloutLedger
from arealite.rollout.loop_thread import LoopThread
from arealite.rollout.ready import ReadyGroups, Waiters
from arealite.rollout.staleness import StalenessManager
from arealite.utils.json_types import JsonObject
from arealite.workflow.base import RolloutWorkflow
from arealite.workflow.fast_group import GroupBuffers

logger = logging.getLogger("arealite.rollout")

#: Whether a finished trajectory group is kept for training.
ShouldAccept = Callable[[TensorDict], bool]


class WorkflowError(RuntimeError):
    """A workflow raised (or returned a malformed trajectory) on one item."""

    def __init__(self, item: JsonObject, tb: str):
        self.item = item
        self.traceback = tb
        super().__init__(
            f"workflow failed on item {_short_repr(item)}; rollout.on_workflow_error='fail' stops the run "
            f"(set it to 'drop' to skip such items). Workflow traceback:\n{tb}"
        )


class InputQueueFull(RuntimeError):
    """``submit`` found the bounded input queue full."""


def _short_repr(item: object, n: int = 300) -> str:
    s = repr(item)
    return s if len(s) <= n else s[:n] + "...}"


@dataclass
class Episode:
    """One item to run through its workflow; ``task`` once admitted."""

    item: JsonObject
    workflow: RolloutWorkflow
    should_accept: ShouldAccept | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    version: int = 0  # the trainer's version when it was admitted: its tokens are no older


class Admission:
    """The input queue and the running episodes of one controller.

    ``ready`` receives the accepted groups, ``staleness`` bounds what runs, ``ledger``
    counts the outcomes, ``dropped`` keeps the items rejected or failed; ``batch_size`` is
    the groups of one training batch on this rank.
    """

    def __init__(self, client: InferenceClient, config: RolloutConfig, batch_size: int, loop_thread: LoopThread,
                 staleness: StalenessManager, ready: ReadyGroups, ledger: RolloutLedger, dropped: DroppedItems):
        self.client = client
        self.config = config
        self.batch_size = batch_size
        self._lt = loop_thread
        self._staleness = staleness
        self._ready = ready
        self._ledger = ledger
        self._dropped = dropped
        self._input: collections.deque[Episode] = collections.deque()
        self._running: dict[int, Episode] = {}
        self._admitted_at: collections.Counter[int] = collections.Counter()  # running episodes by admission version
        self._next_id = 0
        self._waiters = Waiters()
        self._workflows: dict[int, RolloutWorkflow] = {}  # every workflow seen, for their stats
        self._error: WorkflowError | None = None
        self._paused = False
        self._closing = False  # stop() in progress: nothing new is admitted
        self._training = False  # prepare_batch feeds training batches (see `capacity`)

    # ------------------------------------------------------------------ state
    @property
    def queued(self) -> int:
        """Items in the input queue."""
        return len(self._input)

    @property
    def running(self) -> int:
        """Episodes running."""
        return len(self._running)

    def running_admitted_by(self, version: int) -> int:
        """Running episodes admitted at trainer ``version`` or before (an episode's tokens are no
        older than its admission, so they decide which batch it must be trained in)."""
        return sum(n for v, n in self._admitted_at.items() if v <= version)

    @property
    def paused(self) -> bool:
        return self._paused

    @paused.setter
    def paused(self, paused: bool) -> None:
        # The flag alone, from any thread; `set_paused` also admits and wakes (on the loop).
        self._paused = paused

    def unfinished_items(self) -> list[JsonObject]:
        """The items running, then the items queued (for a checkpoint)."""
        return [e.item for e in self._running.values()] + [e.item for e in self._input]

    @property
    def has_error(self) -> bool:
        return self._error is not None

    def take_error(self) -> WorkflowError | None:
        """The first workflow failure under ``on_workflow_error='fail'`` not raised yet."""
        err, self._error = self._error, None
        return err

    def workflow_stats(self) -> dict[str, int]:
        """The counters of every workflow seen (``workflow/<name>``), summed over workflows."""
        out: dict[str, int] = {}
        for wf in self._workflows.values():
            for k, v in wf.stats().items():
                out[f"workflow/{k}"] = out.get(f"workflow/{k}", 0) + v
        return out

    # -------------------------------------------------------------- admission
    def enqueue(self, items: list[JsonObject], workflow: RolloutWorkflow, should_accept: ShouldAccept | None,
                counted: bool) -> None:
        """Put ``items`` in the input queue (all or none), then admit what the bound allows.
        ``counted``: they count as submitted (restored items were, before the restart)."""
        if len(self._input) + len(items) > self.config.queue_size:
            raise InputQueueFull(
                f"input queue cannot take {len(items)} more item(s): it holds {len(self._input)} of "
                f"rollout.queue_size={self.config.queue_size}; consume with wait() first or raise rollout.queue_size"
            )
        self._input.extend(Episode(it, workflow, should_accept) for it in items)
        self._workflows.setdefault(id(workflow), workflow)
        if counted:
            self._ledger.count("submitted", len(items))
        self.admit()

    def start_training(self) -> None:
        """`prepare_batch` feeds training batches from now on (see `capacity`)."""
        self._training = True

    def capacity(self) -> int:
        """How many queued items may start now."""
        if self._paused or self._closing:
            return 0
        # Back-pressure: finished + running groups never exceed the output queue.
        by_output = self.config.queue_size - (len(self._ready) + len(self._running))
        cap = min(self._staleness.capacity(), by_output)
        if self._training and self._ledger["consumed"] == 0:
            # The first training batch overlaps with nothing: it generates alone, so that the
            # trainer starts as soon as it is done; what the bound lets run ahead follows.
            cap = min(cap, self.batch_size - len(self._ready) - len(self._running))
        return max(0, cap)

    def admit(self) -> None:
        """Start the episodes of as many queued items as `capacity` allows."""
        n = min(self.capacity(), len(self._input))
        loop = self._lt.loop
        for _ in range(n):
            ep = self._input.popleft()
            self._staleness.on_submit()
            ep.version = self._staleness.version
            eid = self._next_id
            self._next_id += 1
            self._running[eid] = ep
            self._admitted_at[ep.version] += 1
            ep.task = loop.create_task(self._run(eid, ep))
        if self._waiters:
            self._wake()

    def set_paused(self, paused: bool) -> None:
        """Pause or resume admission (on the loop)."""
        self._paused = paused
        self.admit()
        self._wake(everyone=True)  # waiters re-check the stuck and paused conditions

    async def park(self, want: int, timeout: float | None) -> None:
        """Sleep until ``want`` groups may be ready or something else changed (an error,
        nothing running, a pause), or ``timeout`` seconds pass (None: no limit)."""
        await self._waiters.park(self._lt.loop, want, timeout)

    def _wake(self, everyone: bool = False) -> None:
        if self._waiters:
            self._waiters.wake(len(self._ready), everyone or self._error is not None or not self._running)

    # --------------------------------------------------------------- episodes
    async def _run(self, eid: int, ep: Episode) -> None:
        try:
            wf = ep.workflow  # a duck-typed workflow has arun_episode alone
            td = await (wf.arun_group if isinstance(wf, RolloutWorkflow) else wf.arun_episode)(self.client, ep.item)
            if isinstance(td, GroupBuffers) and ep.should_accept is None:
                td.validate(where=f"workflow {type(wf).__name__}")  # per token well-formed when built
            elif td is not None:
                if isinstance(td, GroupBuffers):
                    td = td.to_tensordict()  # the filter reads a TensorDict
                validate_trajectory(td, where=f"workflow {type(wf).__name__}")
            accept = td is not None and (ep.should_accept is None or bool(ep.should_accept(td)))
        except asyncio.CancelledError:
            raise  # stop(): the episode stays listed as unfinished
        except Exception:
            self._end_running(eid)
            self._staleness.on_reject()
            self._dropped.record([ep.item])
            self._on_failure(ep.item, traceback.format_exc())
        else:
            self._end_running(eid)
            if accept:
                self._staleness.on_accept()
                self._ledger.count("accepted")
                self._ready.put(td, ep.item, ep.version)
            else:
                self._staleness.on_reject()
                self._ledger.count("rejected")
                self._dropped.record([ep.item])
        self.admit()

    def _end_running(self, eid: int) -> None:
        ep = self._running.pop(eid, None)
        if ep is not None:
            self._admitted_at[ep.version] -= 1
            if not self._admitted_at[ep.version]:
                del self._admitted_at[ep.version]

    def _on_failure(self, item: JsonObject, tb: str) -> None:
        self._ledger.count("failed")
        if self.config.on_workflow_error == "drop":
            logger.warning("workflow failed on item %s; dropped (on_workflow_error='drop'):\n%s", _short_repr(item), tb)
        elif self._error is None:
            logger.error("workflow failed on item %s:\n%s", _short_repr(item), tb)
            self._error = WorkflowError(item, tb)

    # ------------------------------------------------------------------- stop
    async def cancel_all(self) -> None:
        """Admit nothing more, cancel the running episodes and wait for them to end."""
        # Admission stops first: an episode finishing while the others are being cancelled
        # would otherwise admit a new one that nobody cancels, and it would fail against
        # the closed HTTP session.
        self._closing = True
        tasks = [e.task for e in self._running.values() if e.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def requeue_unfinished(self) -> None:
        """After the loop stopped: the episodes that never finished go back in front of the
        input queue, so that a checkpoint still lists them; admission may open again."""
        self._input.extendleft(reversed(list(self._running.values())))
        self._running.clear()
        self._admitted_at.clear()
        self._staleness.cancel_running()
        self._closing = False
