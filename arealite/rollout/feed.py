"""The data feed: items in from the dataloader, batches of groups out to the trainer.

Items are pulled from the dataloader (an iterable of lists of items, restarted for a new
epoch when exhausted) whenever the staleness bound leaves room, so the next step's groups
are already generating while the trainer trains on this one. Items restored from a
checkpoint go first, and a dataloader batch that did not fit in the input queue is kept
for next time: no prompt is lost or repeated.

Batches are handed out in completion order (`DataFeed.wait`); a ``should_accept`` given
then filters the groups already ready. At a resume with a whole batch ready, the batch is
taken ahead (`DataFeed.take_ahead`, see `arealite.rollout.ready`).

A `DataFeed` belongs to one controller and runs on its event loop only (but
`take_stashed`, from any thread).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence

from tensordict import TensorDict

from arealite.rollout.admission import Admission, ShouldAccept
from arealite.rollout.dropped import DroppedItems
from arealite.rollout.ledger import RolloutLedger
from arealite.rollout.ready import ReadyGroups
from arealite.rollout.staleness import StalenessManager, overdue_running
from arealite.utils.json_types import JsonObject
from arealite.workflow.base import RolloutWorkflow

#: A dataloader: lists of items, one list per step, epoch after epoch.
ItemBatches = Iterable[Sequence[JsonObject]]


class DataFeed:
    """Feeds ``admission`` from dataloaders and hands out batches of ``ready`` groups."""

    def __init__(self, admission: Admission, ready: ReadyGroups, staleness: StalenessManager,
                 ledger: RolloutLedger, dropped: DroppedItems, batch_size: int):
        self.batch_size = batch_size
        self._admission = admission
        self._ready = ready
        self._staleness = staleness
        self._ledger = ledger
        self._dropped = dropped
        self._iters: dict[int, Iterator[Sequence[JsonObject]]] = {}
        self._leftover: list[JsonObject] = []  # pulled from the dataloader, not queued yet
        #: The items of the last batch handed out (per-prompt accounting).
        self.last_batch_items: list[JsonObject] = []
        #: Seconds training batches waited, with enough groups ready, for a running group that
        #: the staleness bound says they must hold (`_overdue_running`); cumulative.
        self.overdue_wait_s = 0.0

    # ---------------------------------------------------------------- items in
    @property
    def pending(self) -> int:
        """Items waiting to be queued before the dataloader's: restored ones and leftovers."""
        return self._ledger.restored + len(self._leftover)

    def leftover_items(self) -> list[JsonObject]:
        """A copy of the dataloader items pulled but not queued (for a checkpoint)."""
        return list(self._leftover)

    def restore_leftover(self, items: Iterable[JsonObject]) -> None:
        self._leftover = list(items)

    async def prepare(self, dataloader: ItemBatches, workflow: RolloutWorkflow,
                      should_accept: ShouldAccept | None, poll_s: float) -> TensorDict:
        """One batch of ``batch_size`` groups, keeping the pipeline full.

        Every ``poll_s`` seconds without a batch, the input queue is topped up again
        (rejected groups free slots that new items must fill).
        """
        self._admission.start_training()
        while True:
            if self.pending:
                self.drain(workflow, should_accept)
            self.top_up(dataloader, workflow, should_accept)
            try:
                batch = await self.wait(self.batch_size, poll_s, None, hold_overdue=True)
            except TimeoutError:
                continue
            # Refill at once, so that the next step's groups generate while this one trains.
            self.top_up(dataloader, workflow, should_accept)
            return batch

    def top_up(self, dataloader: ItemBatches, workflow: RolloutWorkflow, should_accept: ShouldAccept | None) -> None:
        """Queue dataloader batches until every slot the bound allows is used, and one batch more."""
        adm = self._admission
        while adm.queued < adm.capacity() + self.batch_size:
            batch = self._next_batch(dataloader)
            if adm.queued + len(batch) > adm.config.queue_size:
                self._leftover.extend(batch)  # do not lose it: it goes first next time
                return
            adm.enqueue(batch, workflow, should_accept, counted=True)

    def drain(self, workflow: RolloutWorkflow, should_accept: ShouldAccept | None) -> None:
        """Queue the restored items, then the leftovers, while the input queue has room."""
        adm = self._admission
        # Restored items were counted as submitted before the restart; leftovers were not.
        while self._ledger.restored:
            if adm.queued >= adm.config.queue_size:
                return
            adm.enqueue([self._ledger.next_restored()], workflow, should_accept, counted=False)
        while self._leftover:
            if adm.queued >= adm.config.queue_size:
                return
            adm.enqueue([self._leftover.pop(0)], workflow, should_accept, counted=True)

    def _next_batch(self, dataloader: ItemBatches) -> list[JsonObject]:
        """The dataloader's next list of items, starting a new epoch when it is exhausted."""
        key = id(dataloader)
        for _ in range(2):
            it = self._iters.get(key)
            if it is None:
                it = self._iters[key] = iter(dataloader)
            try:
                batch = next(it)
                if not isinstance(batch, (list, tuple)):
                    raise TypeError(f"the dataloader must yield lists of items, got {type(batch).__name__}")
                return list(batch)
            except StopIteration:
                self._iters.pop(key, None)  # a new epoch
        raise ValueError("the dataloader yields no batch at all (empty dataset, or drop_last with too few items)")

    # ------------------------------------------------------------ batches out
    async def wait(self, count: int, timeout: float | None, should_accept: ShouldAccept | None,
                   hold_overdue: bool = False) -> TensorDict:
        """The oldest ``count`` ready groups as one batch, once they are ready (see
        `RolloutController.wait`). ``hold_overdue`` (a training batch): also once no running
        group would be trained past the staleness bound if left to the next batch."""
        adm = self._admission
        deadline = None if timeout is None else time.monotonic() + timeout
        self.unstash()  # groups are handed out in completion order
        held_since: float | None = None  # enough groups ready, a batch held for an overdue one
        try:
            while True:
                err = adm.take_error()
                if err is not None:
                    raise err
                if should_accept is not None:
                    self._filter(should_accept)
                if len(self._ready) >= count:
                    if not (hold_overdue and self._overdue_running(count)):
                        return self._take(count)
                    if held_since is None:
                        held_since = time.monotonic()
                await self._park_or_raise(count, deadline, timeout)
        finally:
            if held_since is not None:
                self.overdue_wait_s += time.monotonic() - held_since

    async def _park_or_raise(self, count: int, deadline: float | None, timeout: float | None) -> None:
        """Wait for the next change, or raise why none can come in time."""
        adm = self._admission
        if not adm.running and not adm.paused:
            raise self._stuck_error(count)
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise TimeoutError(
                f"wait({count}) timed out after {timeout}s with {len(self._ready)} groups ready, "
                f"{adm.running} running, {adm.queued} queued"
                + (" (controller is paused)" if adm.paused else "")
            )
        await adm.park(count, remaining)

    def _overdue_running(self, count: int) -> bool:
        """Whether a running group must still join this batch of ``count`` to stay within the
        staleness bound (`overdue_running`)."""
        sm, adm = self._staleness, self._admission
        return overdue_running(sm.version, sm.max_head_offpolicyness, count, adm.running,
                               adm.running_admitted_by, self._ready.count_from)

    def _filter(self, should_accept: ShouldAccept) -> None:
        dropped = self._ready.filter(should_accept)
        if dropped:
            self._dropped.record(dropped)
            self._staleness.on_unaccept(len(dropped))
            self._ledger.count("accepted", -len(dropped))
            self._ledger.count("rejected", len(dropped))
            self._admission.admit()

    def _take(self, count: int) -> TensorDict:
        batch, self.last_batch_items = self._ready.take(count, self._staleness.version)
        self._ledger.count("consumed", count)
        self._admission.admit()
        return batch

    def _stuck_error(self, count: int) -> RuntimeError:
        """Why ``wait(count)`` would hang forever: nothing runs and nothing can be admitted."""
        ready, queued, sm = len(self._ready), self._admission.queued, self._staleness
        if queued:
            return RuntimeError(
                f"wait({count}) can never complete: {ready} groups ready, none running, "
                f"{queued} queued but the staleness limit is reached (accepted={sm.accepted} >= "
                f"(eta={sm.max_head_offpolicyness} + version={sm.version} + 1) * batch={sm.consumer_batch_size}); "
                "call set_version() after every training step"
            )
        return RuntimeError(
            f"wait({count}) can never complete: {ready} groups ready, none running or queued; "
            f"submit more items (rejected so far: {self._ledger['rejected']}, failed: {self._ledger['failed']})"
        )

    # ------------------------------------------------------ the batch taken ahead
    def take_ahead(self, dataloader: ItemBatches, workflow: RolloutWorkflow) -> None:
        """At a resume, take the next training batch now if it is whole and nothing else
        would change it, then refill from ``dataloader`` as `prepare` does after a take."""
        adm = self._admission
        if (not adm.has_error and not adm.config.filter_equal_rewards and not self._ready.stashed
                and not self.pending and len(self._ready) >= self.batch_size
                and not self._overdue_running(self.batch_size)):
            self._ready.stash(self.batch_size, self._staleness.version)
            self._ledger.count("consumed", self.batch_size)
            self.top_up(dataloader, workflow, None)

    def take_stashed(self) -> TensorDict | None:
        """The batch taken ahead, if any (from any thread); its items become ``last_batch_items``."""
        stashed = self._ready.take_stashed()
        if stashed is None:
            return None
        batch, self.last_batch_items = stashed
        return batch

    def unstash(self) -> None:
        """A batch taken ahead and not handed out goes back in front (on the loop, or stopped)."""
        self._ledger.count("consumed", -self._ready.unstash())
