"""Feeding the rollout controller from a dataloader (``RolloutController.prepare_batch``).

Items are pulled from the dataloader (an iterable of lists of items, restarted
for a new epoch when exhausted) whenever the staleness bound leaves room, so the
next step's groups are already generating while the trainer trains on this one.
Items restored from a checkpoint go first, and a dataloader batch that did not
fit in the input queue is kept for next time: no prompt is lost or repeated.

A `DataFeed` belongs to one controller and runs on its event loop only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from tensordict import TensorDict

if TYPE_CHECKING:
    from arealite.rollout.controller import RolloutController
    from arealite.workflow.base import RolloutWorkflow

ShouldAccept = Callable[[TensorDict], bool]


class DataFeed:
    """The controller's source of items: restored ones first, then the dataloader's, epoch after epoch."""

    def __init__(self, controller: "RolloutController"):
        self._ctl = controller
        self._iters: dict[int, Iterator] = {}
        #: Unfinished items restored from a checkpoint (counted as submitted before the restart).
        self.restored: list[Any] = []
        #: Items pulled from the dataloader but not yet submitted (the input queue was full).
        self.leftover: list[Any] = []
        #: Whether `prepare` was ever called (the controller then feeds training batches).
        self.started = False

    def __len__(self) -> int:
        return len(self.restored) + len(self.leftover)

    async def prepare(self, dataloader: Iterable, workflow: "RolloutWorkflow",
                      should_accept: ShouldAccept | None, poll_s: float) -> TensorDict:
        """One batch of the controller's ``batch_size`` groups, keeping the pipeline full.

        Every ``poll_s`` seconds without a batch, the input queue is topped up again
        (rejected groups free slots that new items must fill).
        """
        ctl = self._ctl
        self.started = True
        while True:
            if self.restored or self.leftover:
                self.drain(workflow, should_accept)
            self.top_up(dataloader, workflow, should_accept)
            try:
                batch = await ctl._wait_on_loop(ctl.batch_size, poll_s, None)
            except TimeoutError:
                continue
            # Refill at once, so that the next step's groups generate while this one trains.
            self.top_up(dataloader, workflow, should_accept)
            return batch

    def top_up(self, dataloader: Iterable, workflow: "RolloutWorkflow", should_accept: ShouldAccept | None) -> None:
        """Queue dataloader batches until every slot the bound allows is used, and one batch more."""
        ctl = self._ctl
        while len(ctl._input) < ctl._capacity() + ctl.batch_size:
            batch = self.next_batch(dataloader)
            if len(ctl._input) + len(batch) > ctl.config.queue_size:
                self.leftover.extend(batch)  # do not lose it: it goes first next time
                return
            ctl._enqueue_on_loop(batch, workflow, should_accept, counted=True)

    def drain(self, workflow: "RolloutWorkflow", should_accept: ShouldAccept | None) -> None:
        """Queue the restored items, then the leftovers, while the input queue has room."""
        ctl = self._ctl
        # Restored items were counted as submitted before the restart; leftovers were not.
        for pending, counted in ((self.restored, False), (self.leftover, True)):
            while pending:
                if len(ctl._input) >= ctl.config.queue_size:
                    return
                ctl._enqueue_on_loop([pending.pop(0)], workflow, should_accept, counted=counted)

    def next_batch(self, dataloader: Iterable) -> list[Any]:
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
