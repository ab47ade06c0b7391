"""The rollout controller's ledger: how many items were submitted, accepted, rejected,
failed and consumed, the trainer's policy version, and the items still owed after a resume.

A checkpoint saves the counters; the items that were running or queued then come back as
*restored* items: counted as submitted before the restart, so their resubmission is not
counted again (`arealite.rollout.feed.DataFeed.drain` takes them first).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping

from arealite.utils.json_types import JsonObject

#: The events counted, in the order `RolloutLedger.counts` lists them.
EVENTS = ("submitted", "accepted", "rejected", "failed", "consumed")


class RolloutLedger:
    """Counters, version and restored items of one controller (touched on its loop, or while it
    is stopped; ``version`` from the trainer's thread)."""

    def __init__(self) -> None:
        self._counts = dict.fromkeys(EVENTS, 0)
        #: The version last given to ``set_version`` (or restored from a checkpoint).
        self.version = 0
        self._restored: collections.deque[JsonObject] = collections.deque()

    def count(self, event: str, n: int = 1) -> None:
        """Add ``n`` (may be negative: a batch put back) to the ``event`` counter."""
        self._counts[event] += n

    def __getitem__(self, event: str) -> int:
        return self._counts[event]

    def counts(self) -> dict[str, int]:
        """A copy of every counter."""
        return dict(self._counts)

    # ---------------------------------------------------------- restored items
    @property
    def restored(self) -> int:
        """Items restored from a checkpoint and not resubmitted yet."""
        return len(self._restored)

    def next_restored(self) -> JsonObject:
        """The oldest restored item, taken out for resubmission."""
        return self._restored.popleft()

    def restored_items(self) -> list[JsonObject]:
        """A copy of the restored items not resubmitted yet (for a checkpoint)."""
        return list(self._restored)

    # -------------------------------------------------------------- checkpoint
    def restore(self, counts: Mapping[str, int], version: int, unfinished: Iterable[JsonObject]) -> None:
        """Counters and version of a checkpoint, and the items it saved unfinished."""
        self._counts.update({k: int(v) for k, v in counts.items()})
        self.version = version
        self._restored = collections.deque(unfinished)
