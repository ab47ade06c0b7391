"""The accepted groups waiting to be trained on, how a batch is assembled from them, and the
callers waiting for them.

Groups wait in completion order and a batch takes the stalest of them (completion order among
equals), each with the dataset item it came from, so
that the trainer knows which prompts a batch holds (per-prompt accounting) and a
checkpoint can save the groups produced but not yet trained on. Taking a batch
records the staleness of its trajectories in a histogram. (A training batch also waits for
a running group that would overrun the staleness bound in the next one: `DataFeed.wait`.)

A group's age is the version it was admitted at, when the controller gives it (`put`): its
tokens are no older, and it is the version `Admission.running_admitted_by` counts running
groups by (the client cannot see a running answer's tokens), so the overdue rule compares like
with like. Ready groups counted by their tokens' versions instead (newer when an answer waited in
a server's queue past a push) could make a batch wait for a running group no staler than ready
ones. A group put without it (restored from an older checkpoint) is aged by its tokens' oldest
version. The staleness histogram still counts tokens.

A batch can also be taken ahead of its ``prepare_batch`` (`ReadyGroups.stash`): when a
weight update resumes generation with a whole batch already ready, the controller takes
it before launching the episodes the update released, and the trainer's next call picks
it up from any thread (`take_stashed`) instead of queueing on the loop behind that burst.
Until then it can be put back in front (`unstash`), as for a checkpoint.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import threading
from dataclasses import dataclass
from typing import Callable, NotRequired, TypedDict

import torch
from tensordict import TensorDict

from arealite.rollout.staleness import NO_PRODUCED_TOKEN, oldest_versions, produced_versions, trajectory_staleness
from arealite.utils.json_types import JsonObject
from arealite.workflow.base import TrajectoryGroup, concat_trajectories
from arealite.workflow.fast_group import GroupBuffers


class ReadyState(TypedDict):
    """What a checkpoint keeps of the waiting groups: each as a plain dict of tensors with its
    item, and the staleness histogram of the batches taken."""

    ready: list[tuple[dict[str, torch.Tensor], JsonObject]]
    staleness_hist: dict[int, int]
    admitted_at: NotRequired[list[int | None]]
    """Each waiting group's age (`ReadyGroups.put`), in the order of ``ready``."""


@dataclass
class _Stash:
    """A batch taken ahead of its `prepare_batch`: its groups, the batch, items and staleness."""

    groups: list[tuple[TrajectoryGroup, JsonObject]]
    ages: list[int | None]
    batch: TensorDict
    items: list[JsonObject]
    stale: list[int]


def _oldest_version(td: TensorDict) -> int:
    """The oldest policy version among a group's produced tokens (a group with none sorts last)."""
    return int(oldest_versions(td["versions"], td["loss_mask"]).min())


def _oldest_of_groups(groups: list[TrajectoryGroup]) -> list[int]:
    """`_oldest_version` of each of ``groups``, with one set of tensor ops for all of them: per
    group, the ``where`` + ``amin`` cost ~12 us of the loop's CPU per trajectory on
    bench_controller (every take ages the groups that came since the last one)."""
    tds = [_tensordict(g) for g in groups]
    if len(tds) == 1:
        return [_oldest_version(tds[0])]
    vers = [td["versions"].reshape(-1) for td in tds]
    mask = torch.cat([td["loss_mask"].reshape(-1) for td in tds])
    group = torch.repeat_interleave(torch.arange(len(tds)), torch.tensor([v.numel() for v in vers]))
    produced = produced_versions(torch.cat(vers), mask)
    out = torch.full((len(tds),), NO_PRODUCED_TOKEN, dtype=torch.int64)
    return out.scatter_reduce_(0, group, produced, "amin").tolist()


def _tensordict(group: TrajectoryGroup) -> TensorDict:
    return group.to_tensordict() if isinstance(group, GroupBuffers) else group


class ReadyGroups:
    """The waiting ``(trajectory group, item)`` pairs, taken stalest first, with the staleness
    histogram of what was taken, and at most one batch taken ahead (the stash)."""

    def __init__(self) -> None:
        # Waiting groups by sequence number: completion order, a batch put back in front
        # (`unstash`) numbered below every other (`_first`), new ones above (`_next`).
        self._groups: dict[int, tuple[TrajectoryGroup, JsonObject]] = {}
        self._first, self._next = 0, 0
        # The stalest-first index, filled lazily (`_index`): each group's age computed once
        # and its number pushed on its age's heap. A number whose group is gone stays in a
        # heap until popped (skipped then), so a take costs O(count log n), not O(n).
        self._oldest: dict[int, int] = {}  # seq -> its age: admission version, else oldest token's
        self._unindexed: list[int] = []
        self._by_age: dict[int, list[int]] = {}  # age -> heap of seqs
        self.staleness_hist: collections.Counter[int] = collections.Counter()
        self._stash: _Stash | None = None
        self._stash_lock = threading.Lock()  # take_stashed() runs on the trainer's thread

    def __len__(self) -> int:
        return len(self._groups)

    def put(self, td: TrajectoryGroup, item: JsonObject, admitted_at: int | None = None) -> None:
        """A finished group; ``admitted_at``: the version it was admitted at (its age), if known."""
        if admitted_at is not None:
            self._oldest[self._next] = admitted_at
        self._add(self._next, td, item)
        self._next += 1

    def _add(self, seq: int, td: TrajectoryGroup, item: JsonObject) -> None:
        self._groups[seq] = (td, item)
        self._unindexed.append(seq)

    def count_from(self, version: int) -> int:
        """How many waiting groups are of age ``version`` or older."""
        self._age_all(self._groups)
        return sum(1 for seq in self._groups if self._oldest[seq] <= version)

    def _age_all(self, seqs) -> None:
        """Age every group of ``seqs`` put without its admission version by its tokens' oldest
        (`_oldest_version`), all in one batch (`_oldest_of_groups`), once per group."""
        groups, oldest = self._groups, self._oldest
        new = [seq for seq in seqs if seq in groups and seq not in oldest]
        if new:
            oldest.update(zip(new, _oldest_of_groups([groups[seq][0] for seq in new])))

    def take(self, count: int, version: int) -> tuple[TensorDict, list[JsonObject]]:
        """The stalest ``count`` groups as one right-padded batch, and their items."""
        s = self._pop(count, version)
        return s.batch, s.items

    def _pop(self, count: int, version: int) -> _Stash:
        taken, ages = self._stalest(count)
        batch = concat_trajectories([td for td, _ in taken])
        stale = trajectory_staleness(batch["versions"], batch["loss_mask"], version).tolist()
        self.staleness_hist.update(stale)
        return _Stash(taken, ages, batch, [item for _, item in taken], stale)

    def _stalest(self, count: int) -> tuple[list[tuple[TrajectoryGroup, JsonObject]], list[int | None]]:
        """Remove and return the ``count`` oldest groups by age (ties and
        the batch itself in completion order). A group that finished late behind a long answer
        thus goes before the fresher groups that overtook it, instead of waiting behind them
        and growing staler. With no choice to make (``count`` or fewer waiting) it costs nothing.

        The choice pops the oldest ages' heaps: a backlog of thousands of groups (a producer
        ahead of its trainer, bench_controller) cost a sort of all of them per batch before.
        Their ages come with them (None where not known), for `unstash`."""
        groups, oldest = self._groups, self._oldest
        if len(groups) <= count:
            if len(groups) < count:
                raise IndexError(f"take({count}) with {len(groups)} groups waiting")
            order = sorted(groups)
            taken, ages = [groups[seq] for seq in order], [oldest.get(seq) for seq in order]
            groups.clear()
            self._clear_index()
            return taken, ages
        self._index()
        chosen: list[int] = []
        by_age = self._by_age
        for age in sorted(by_age):
            heap = by_age[age]
            while heap and len(chosen) < count:
                seq = heapq.heappop(heap)
                if seq in groups:
                    chosen.append(seq)
            if not heap:
                del by_age[age]
            if len(chosen) == count:
                break
        chosen.sort()
        ages = [oldest.pop(seq, None) for seq in chosen]
        return [groups.pop(seq) for seq in chosen], ages

    def _index(self) -> None:
        """Age the groups not indexed yet and push them on their age's heap."""
        groups, by_age = self._groups, self._by_age
        self._age_all(self._unindexed)
        for seq in self._unindexed:
            if seq in groups:
                heapq.heappush(by_age.setdefault(self._oldest[seq], []), seq)
        self._unindexed.clear()

    def _clear_index(self) -> None:
        """Forget the index (every group it held is gone, or about to be re-added)."""
        self._unindexed = list(self._groups)
        self._by_age.clear()
        self._oldest = {seq: self._oldest[seq] for seq in self._groups if seq in self._oldest}

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
        for (td, item), age in zip(reversed(s.groups), reversed(s.ages)):
            self._first -= 1
            if age is not None:
                self._oldest[self._first] = age
            self._add(self._first, td, item)
        self.staleness_hist.subtract(s.stale)
        self.staleness_hist = +self.staleness_hist  # drop the counts that went back to 0
        return len(s.groups)

    def filter(self, should_accept: Callable[[TensorDict], bool]) -> list[JsonObject]:
        """Drop the groups ``should_accept`` refuses; return their items."""
        dropped = []
        for seq in sorted(self._groups):
            group, item = self._groups[seq]
            td = _tensordict(group)  # the filter reads a TensorDict: built once, kept
            self._groups[seq] = (td, item)
            if not should_accept(td):
                dropped.append(item)
                del self._groups[seq]
        if dropped:
            self._clear_index()
        return dropped

    def state_dict(self) -> ReadyState:
        """The waiting groups (as plain dicts) with their ages, and the histogram."""
        order = sorted(self._groups)
        return {
            "ready": [(_tensordict(self._groups[seq][0]).to_dict(), self._groups[seq][1]) for seq in order],
            "staleness_hist": dict(self.staleness_hist),
            "admitted_at": [self._oldest.get(seq) for seq in order],
        }

    def load_state_dict(self, state: ReadyState) -> None:
        self.staleness_hist = collections.Counter({int(k): int(v) for k, v in state["staleness_hist"].items()})
        self._groups.clear()
        self._clear_index()
        ages = state.get("admitted_at") or [None] * len(state["ready"])  # older checkpoints: by tokens
        for (d, item), age in zip(state["ready"], ages):
            self.put(TensorDict(d, batch_size=[d["input_ids"].shape[0]]), item, age)


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
