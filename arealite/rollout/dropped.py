"""The items the rollout will not train on (groups rejected, or failed and dropped), kept
for the per-prompt accounting (`arealite.utils.accounting`)."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from arealite.utils.json_types import JsonObject


class DroppedItems:
    """A list the controller's loop appends to and the trainer's thread takes from.

    It is guarded by a lock instead of being read on the loop: the trainer asks right
    after a weight update, when the loop is busy launching the episodes the update
    released, and must not wait behind them. Items are kept only while ``recording``
    (someone takes them: the trainer's per-prompt accounting).
    """

    def __init__(self) -> None:
        self.recording = False
        self._items: list[JsonObject] = []
        self._lock = threading.Lock()

    def record(self, items: Iterable[JsonObject]) -> None:
        """Keep ``items`` as dropped (nothing happens unless ``recording``)."""
        if self.recording:
            with self._lock:
                self._items.extend(items)

    def take(self) -> list[JsonObject]:
        """Everything dropped since the last call."""
        with self._lock:
            out, self._items = self._items, []
        return out

    def snapshot(self) -> list[JsonObject]:
        """A copy, left in place (for a checkpoint)."""
        with self._lock:
            return list(self._items)

    def restore(self, items: Iterable[JsonObject]) -> None:
        with self._lock:
            self._items = list(items)
