"""Prompt datasets: JSONL loading with validation, and a stateful, rank-sharded dataloader.

``load_jsonl`` fails on the first bad row with its line number and field, so a
broken dataset stops the run before any server starts. ``StatefulDataLoader``
yields lists of items (dicts), reshuffles every epoch from ``seed + epoch``,
gives each rank its own shard, and saves ``(epoch, index)`` so that a resumed
run continues with exactly the next batch.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any, Iterator, Sequence


class DatasetError(ValueError):
    """A dataset file or row is malformed."""


def _check_prompt(value: Any, where: str, key: str) -> None:
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"{where}: field '{key}' is an empty string")
        return
    if isinstance(value, list) and value:
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DatasetError(
                    f"{where}: field '{key}'[{i}] must be a message {{'role': str, 'content': str}}, got {m!r:.80}"
                )
        return
    raise DatasetError(
        f"{where}: field '{key}' must be a non-empty string or a list of chat messages, got {type(value).__name__}"
    )


def load_jsonl(
    path: str | Path,
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    required_keys: Sequence[str] = (),
    max_rows: int | None = None,
) -> "DatasetRows":
    """Read a JSONL file of prompts; validate every row; give each a stable ``prompt_id``.

    Rows must be JSON objects with ``prompt_key`` (a string or a list of chat
    messages) and, unless ``answer_key`` is None, ``answer_key`` (string or
    number). Blank lines are skipped; any other bad line is an error naming its
    line number and field. ``prompt_id`` is the row's index unless the row has one.
    The rows come back as ``DatasetRows``, a list that remembers each row's line so that
    later checks (``arealite.data.validate``) can name it.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    rows: list[dict[str, Any]] = []
    seen_ids: dict[int, int] = {}
    line_numbers: list[int] = []
    # Binary read, decoded per line: a bad byte is reported with its line, not as a bare UnicodeDecodeError.
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{where}: not valid UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})") from None
            if not line.strip():
                continue
            if max_rows is not None and len(rows) >= max_rows:
                break
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{where}: each line must be a JSON object, got {type(row).__name__}")
            if prompt_key not in row:
                raise DatasetError(f"{where}: missing field '{prompt_key}' (fields: {sorted(row)}); set data.prompt_key")
            _check_prompt(row[prompt_key], where, prompt_key)
            if answer_key is not None:
                if answer_key not in row:
                    raise DatasetError(f"{where}: missing field '{answer_key}' (fields: {sorted(row)}); set data.answer_key")
                ans = row[answer_key]
                if isinstance(ans, bool) or not isinstance(ans, (str, int, float)):
                    raise DatasetError(f"{where}: field '{answer_key}' must be a string or a number, got {type(ans).__name__}")
                if isinstance(ans, float) and not math.isfinite(ans):  # json.loads accepts NaN and Infinity
                    raise DatasetError(f"{where}: field '{answer_key}' is {ans}; it must be a finite number or a string")
            for k in required_keys:
                if k not in row:
                    raise DatasetError(f"{where}: missing required field '{k}'")
            if "prompt_id" in row:
                pid = row["prompt_id"]
                if isinstance(pid, bool) or not isinstance(pid, int):
                    raise DatasetError(f"{where}: field 'prompt_id' must be an integer, got {pid!r}")
            else:
                row["prompt_id"] = len(rows)
            if row["prompt_id"] in seen_ids:
                raise DatasetError(
                    f"{where}: prompt_id {row['prompt_id']} already used by row {seen_ids[row['prompt_id']]}; "
                    "prompt ids must be unique"
                )
            seen_ids[row["prompt_id"]] = len(rows)
            if answer_key is not None and answer_key != "answer" and "answer" not in row:
                row["answer"] = row[answer_key]  # reward functions take `answer`
            rows.append(row)
            line_numbers.append(lineno)
    if not rows:
        raise DatasetError(f"{path}: the dataset is empty (no non-blank lines)")
    return DatasetRows(rows, source=str(path), line_numbers=line_numbers)


class DatasetRows(list):
    """The rows of a file, remembering where each came from so that later checks can name its line."""

    def __init__(self, rows: Sequence[Any] = (), source: str | None = None, line_numbers: Sequence[int] | None = None):
        super().__init__(rows)
        self.source = source
        self.line_numbers = list(line_numbers) if line_numbers is not None else None

    def __getitem__(self, index):
        if isinstance(index, slice):  # `rows[:n]` keeps the line numbers of the rows it keeps
            lines = self.line_numbers[index] if self.line_numbers is not None else None
            return DatasetRows(super().__getitem__(index), self.source, lines)
        return super().__getitem__(index)

    def where(self, i: int) -> str:
        """``path:line`` of row ``i`` when known, else ``row i``."""
        if self.source and self.line_numbers is not None:
            return f"{self.source}:{self.line_numbers[i]}"
        return f"row {i}"


class StatefulDataLoader:
    """Batches of items for one trainer rank; deterministic per (seed, epoch); resumable.

    Every epoch the whole dataset is permuted with ``seed + epoch`` (when
    ``shuffle``) and rank ``r`` takes positions ``r, r + world_size, ...``.
    With ``drop_last`` the tail that does not fill a whole batch on every rank
    is dropped (a different tail each shuffled epoch); without it the shard is
    padded by wrapping around so that all ranks take the same number of steps.
    Iterating yields the rest of the current epoch, then moves to the next.
    """

    def __init__(
        self,
        items: Sequence[Any],
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        if not items:
            raise ValueError("the dataset is empty")
        self.items = list(items)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        if len(self) == 0:
            raise ValueError(
                f"{len(self.items)} items over {world_size} ranks give no full batch of {batch_size}; "
                "lower the batch size or set drop_last=False"
            )
        self.epoch = 0
        self.index = 0  # batches of the current epoch already yielded

    def _shard(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        per_rank = self._per_rank()
        if not self.drop_last and len(order) < per_rank * self.world_size:
            order = (order * (per_rank * self.world_size // len(order) + 1))[: per_rank * self.world_size]
        return order[self.rank : per_rank * self.world_size : self.world_size]

    def _per_rank(self) -> int:
        n = len(self.items)
        if self.drop_last:
            return (n // self.world_size) // self.batch_size * self.batch_size
        return -(-n // self.world_size)

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        per_rank = self._per_rank()
        return per_rank // self.batch_size if self.drop_last else -(-per_rank // self.batch_size)

    def __iter__(self) -> Iterator[list[Any]]:
        shard = self._shard(self.epoch)
        n = len(self)
        while self.index < n:
            start = self.index * self.batch_size
            batch = [self.items[i] for i in shard[start : start + self.batch_size]]
            # Advance before yielding: state_dict() taken after receiving a batch resumes after it.
            self.index += 1
            yield batch
        self.epoch += 1
        self.index = 0

    def state_dict(self) -> dict[str, int]:
        """Position (epoch, batches yielded in it) plus what must match on resume."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "n_items": len(self.items),
                "world_size": self.world_size, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for k in ("seed", "n_items", "world_size", "batch_size"):
            mine = len(self.items) if k == "n_items" else getattr(self, k)
            if k in state and state[k] != mine:
                raise ValueError(
                    f"dataloader state has {k}={state[k]} but this dataloader has {k}={mine}; "
                    "resume with the same dataset and settings"
                )
        if not 0 <= state["index"] <= len(self):
            raise ValueError(f"dataloader state index {state['index']} is outside [0, {len(self)}]")
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
