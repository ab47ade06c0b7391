"""The accepted groups waiting to be trained on, how a batch is assembled from them, and the
callers waiting for them.

Groups wait in completion order and a batch takes the stalest of them (its tokens' oldest
policy version; completion order among equals), each with the dataset item it came from, so
that the trainer knows which prompts a batch holds (per-prompt accounting) and a
checkpoint can save the groups produced but not yet trained on. Taking a batch
records the staleness of its trajectories in a histogram. (A training batch also waits for
a running group that would overrun the staleness bound in the next one: `DataFeed.wait`.)

A batch can also be taken ahead of its ``prepare_batch`` (`ReadyGroups.stash`): when a
weight update resumes generation with a whole batch already ready, the controller takes
it before launching the episodes the update released, and the trainer's next call picks
it up from any thread (`take_stashed`) instead of queueing on the loop behind that burst.
Until then it can be put back in front (`unstash`), as for a checkpoint.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from dataclasses import dataclass
from typing import Callable, TypedDict

import torch
from tensordict import TensorDict

from arealite.rollout.staleness import oldest_versions, trajectory_staleness
from arealite.utils.json_types import JsonObject
from arealite.workflow.base import concat_trajectories


class ReadyState(TypedDict):
    """What a checkpoint keeps of the waiting groups: each as a plain dict of tensors with its
    item, and the staleness histogram of the batches taken."""

    ready: list[tuple[dict[str, torch.Tensor], JsonObject]]
    staleness_hist: dict[int, int]


@dataclass
class _Stash:
    """A batch taken ahead of its `prepare_batch`: its groups, the batch, items and staleness."""

    groups: list[tuple[TensorDict, JsonObject]]
    batch: TensorDict
    items: list[JsonObject]
    stale: list[int]


def _oldest_version(td: TensorDict) -> int:
    """The oldest policy version among a group's produced tokens (a group with none sorts last)."""
    return int(oldest_versions(td["versions"], td["loss_mask"]).min())


class ReadyGroups:
    """The waiting ``(trajectory group, item)`` pairs, taken stalest first, with the staleness
    histogram of what was taken, and at most one batch taken ahead (the stash)."""

    def __init__(self) -> None:
        self._groups: collections.deque[tuple[TensorDict, JsonObject]] = collections.deque()
        self._oldest: dict[int, int] = {}  # id(group) -> its oldest produced token's version, once
        self.staleness_hist: collections.Counter[int] = collections.Counter()
        self._stash: _Stash | None = None
        self._stash_lock = threading.Lock()  # take_stashed() runs on the trainer's thread

    def __len__(self) -> int:
        return len(self._groups)

    def put(self, td: TensorDict, item: JsonObject) -> None:
        self._groups.append((td, item))

    def count_from(self, version: int) -> int:
        """How many waiting groups hold a produced token of ``version`` or older."""
        return sum(1 for td, _ in self._groups if self._age(td) <= version)

    def _age(self, td: TensorDict) -> int:
        """`_oldest_version` of a waiting group, computed once (its tokens never change)."""
        v = self._oldest.get(id(td))
        if v is None:
            v = self._oldest[id(td)] = _oldest_version(td)
        return v

    def take(self, count: int, version: int) -> tuple[TensorDict, list[JsonObject]]:
        """The stalest ``count`` groups as one right-padded batch, and their items."""
        s = self._pop(count, version)
        return s.batch, s.items

    def _pop(self, count: int, version: int) -> _Stash:
        taken = self._stalest(count)
        batch = concat_trajectories([td for td, _ in taken])
        stale = trajectory_staleness(batch["versions"], batch["loss_mask"], version).tolist()
        self.staleness_hist.update(stale)
        return _Stash(taken, batch, [item for _, item in taken], stale)

    def _stalest(self, count: int) -> list[tuple[TensorDict, JsonObject]]:
        """Remove and return the ``count`` groups whose oldest produced token is oldest (ties and
        the batch itself in completion order). A group that finished late behind a long answer
        thus goes before the fresher groups that overtook it, instead of waiting behind them
        and growing staler. With no choice to make (``count`` or fewer waiting) it costs nothing."""
        groups = self._groups
        if len(groups) <= count:
            taken = [groups.popleft() for _ in range(count)]
        else:
            oldest = [self._age(td) for td, _ in groups]
            chosen = sorted(sorted(range(len(groups)), key=oldest.__getitem__)[:count])
            taken = [groups[i] for i in chosen]
            keep = set(range(len(groups))) - set(chosen)
            self._groups = collections.deque(g for i, g in enumerate(groups) if i in keep)
        for td, _ in taken:  # ids are reused once a group is gone
            self._oldest.pop(id(td), None)
        return taken

    # ------------------------------------------------------------ the stash
    @property
    def stashed(self) -> int:
        """Groups in the stash (0 or a batch)."""
        s = self._stash
        return 0 if s is None else len(s.groups)

    def stash(self, count: int, version: int) -> None:
        """Take the stalest ``count`` groups now, as `take` would, and keep the batch for
        `take_stashed` (on the loop; at most one batch is stashed)."""
        if self._stash is not None:
            raise RuntimeError("a batch is stashed already: take_stashed() or unstash() it first")
        s = self._pop(count, version)
        with self._stash_lock:
            self._stash = s

    def take_stashed(self) -> tuple[TensorDict, list[JsonObject]] | None:
        """The stashed batch and its items (None when there is none); any thread."""
        with self._stash_lock:
            s, self._stash = self._stash, None
        return None if s is None else (s.batch, s.items)

    def unstash(self) -> int:
        """Put a stashed batch's groups back in front, as if never taken; returns how many
        (on the loop)."""
        with self._stash_lock:
            s, self._stash = self._stash, None
        if s is None:
            return 0
        self._groups.extendleft(reversed(s.groups))
        self.staleness_hist.subtract(s.stale)
        self.staleness_hist = +self.staleness_hist  # drop the counts that went back to 0
        return len(s.groups)

    def filter(self, should_accept: Callable[[TensorDict], bool]) -> list[JsonObject]:
        """Drop the groups ``should_accept`` refuses; return their items."""
        kept: collections.deque[tuple[TensorDict, JsonObject]] = collections.deque()
        dropped = []
        for td, item in self._groups:
            if should_accept(td):
                kept.append((td, item))
            else:
                dropped.append(item)
                self._oldest.pop(id(td), None)
        if dropped:
            self._groups = kept
        return dropped

    def state_dict(self) -> ReadyState:
        """The waiting groups (as plain dicts) and the histogram."""
        return {
            "ready": [(td.to_dict(), item) for td, item in self._groups],
            "staleness_hist": dict(self.staleness_hist),
        }

    def load_state_dict(self, state: ReadyState) -> None:
        self.staleness_hist = collections.Counter({int(k): int(v) for k, v in state["staleness_hist"].items()})
        self._oldest.clear()
        self._groups = collections.deque(
            (TensorDict(d, batch_size=[d["input_ids"].shape[0]]), item) for d, item in state["ready"]
        )


class Waiters:
    """``wait()`` callers parked on the event loop, each wanting some number of groups.

    They are woken only when they may be able to return (enough groups, or a change
    that they must re-check), not on every finished episode.
    """

    def __init__(self) -> None:
        self._parked: list[tuple[asyncio.Future, int]] = []

    def __bool__(self) -> bool:
        return bool(self._parked)

    async def park(self, loop: asyncio.AbstractEventLoop, want: int, timeout: float | None) -> None:
        """Sleep until woken or ``timeout`` seconds pass (None: no limit)."""
        fut = loop.create_future()
        entry = (fut, want)
        self._parked.append(entry)
        timer = None if timeout is None else loop.call_later(timeout, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            self._parked.remove(entry)
            if timer is not None:
                timer.cancel()

    def wake(self, ready: int, everyone: bool = False) -> None:
        """Wake the callers that want at most ``ready`` groups (all of them if ``everyone``)."""
        for fut, want in self._parked:
            if not fut.done() and (everyone or ready >= want):
                fut.set_result(None)
