"""Prompt datasets: loading with validation, and a stateful, rank-sharded dataloader.

``load_items`` reads the formats users already have, chosen by the path: a
JSONL file (read natively, no extra dependency), a Parquet file, or a
directory written by ``datasets.Dataset.save_to_disk`` (both through the
``datasets`` library: ``pip install 'arealite[data]'``). Every row is checked
the same way whatever the format, and the first bad row fails with its place
(``file:line`` or ``file row N``) and field, so a broken dataset stops the run
before any server starts. ``StatefulDataLoader`` yields lists of items (dicts),
reshuffles every epoch from ``seed + epoch``, gives each rank its own shard,
and saves ``(epoch, index)`` so that a resumed run continues with exactly the
next batch.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from arealite.utils.json_types import JsonObject, JsonValue


class DatasetError(ValueError):
    """A dataset file or row is malformed."""


#: What ``load_items`` reads, for messages.
FORMATS = "a JSONL file (.jsonl), a Parquet file (.parquet) or a directory saved by datasets' save_to_disk"


def load_items(
    path: str | Path,
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    required_keys: Sequence[str] = (),
    max_rows: int | None = None,
    image_key: str | None = None,
) -> "DatasetRows":
    """Read a dataset of prompts from ``path``, whatever its format; validate every row.

    ``path`` is a Parquet file (``.parquet``), a directory saved with
    ``Dataset.save_to_disk``, or else a JSONL file. Rows must hold
    ``prompt_key`` (a string or a list of chat messages) and, unless
    ``answer_key`` is None, ``answer_key`` (string or number); each gets a
    stable ``prompt_id`` (its index unless it has one). See ``load_jsonl``.
    ``image_key``: the field of a row's images (vision-language data); its relative file
    paths are made absolute against the data file's folder (`arealite.vision.dataset_checks`
    checks the images themselves).
    """
    path = Path(path)
    if path.is_dir():
        rows = _load_table(path, "saved dataset", prompt_key, answer_key, required_keys, max_rows)
    elif not path.exists():
        raise DatasetError(f"dataset not found: {path} (expected {FORMATS})")
    elif path.suffix.lower() == ".parquet":
        rows = _load_table(path, "Parquet", prompt_key, answer_key, required_keys, max_rows)
    else:
        rows = load_jsonl(path, prompt_key, answer_key, required_keys, max_rows)
    if image_key is not None:
        from arealite.data.image_sources import as_list, resolve_paths

        base = path if path.is_dir() else path.parent
        for row in rows:
            if image_key in row:
                row[image_key] = resolve_paths(as_list(row[image_key]), base)
    return rows


def _check_prompt(value: JsonValue, where: str, key: str) -> None:
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"{where}: field '{key}' is an empty string")
        return
    if isinstance(value, list) and value:
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and (isinstance(m.get("content"), str) or _is_parts(m.get("content")))):
                raise DatasetError(
                    f"{where}: field '{key}'[{i}] must be a message {{'role': str, 'content': str}} "
                    f"(or content parts [{{'type': 'text' | 'image', ...}}]), got {m!r:.80}"
                )
        return
    raise DatasetError(
        f"{where}: field '{key}' must be a non-empty string or a list of chat messages, got {type(value).__name__}"
    )


def _is_parts(content: JsonValue) -> bool:
    # Vision-language content: [{"type": "text", "text": ...}, {"type": "image"}, ...]
    return isinstance(content, list) and bool(content) and all(
        isinstance(p, dict) and (p.get("type") in ("image", "image_url")
                                 or (p.get("type") == "text" and isinstance(p.get("text"), str)))
        for p in content)


class _RowChecker:
    """The per-row checks every format shares; gives rows their ``prompt_id``."""

    def __init__(self, prompt_key: str, answer_key: str | None, required_keys: Sequence[str]):
        self.prompt_key, self.answer_key, self.required_keys = prompt_key, answer_key, tuple(required_keys)
        self.seen_ids: dict[int, int] = {}

    def __call__(self, row: JsonValue, where: str, index: int) -> JsonObject:
        """Check ``row`` (the ``index``-th kept) in place and return it."""
        prompt_key, answer_key = self.prompt_key, self.answer_key
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
        for k in self.required_keys:
            if k not in row:
                raise DatasetError(f"{where}: missing required field '{k}'")
        if "prompt_id" in row:
            pid = row["prompt_id"]
            if isinstance(pid, bool) or not isinstance(pid, int):
                raise DatasetError(f"{where}: field 'prompt_id' must be an integer, got {pid!r}")
        else:
            row["prompt_id"] = index
        if row["prompt_id"] in self.seen_ids:
            raise DatasetError(
                f"{where}: prompt_id {row['prompt_id']} already used by row {self.seen_ids[row['prompt_id']]}; "
                "prompt ids must be unique"
            )
        self.seen_ids[row["prompt_id"]] = index
        if answer_key is not None and answer_key != "answer" and "answer" not in row:
            row["answer"] = row[answer_key]  # reward functions take `answer`
        return row


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
    check = _RowChecker(prompt_key, answer_key, required_keys)
    rows: list[JsonObject] = []
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
            rows.append(check(row, where, len(rows)))
            line_numbers.append(lineno)
    if not rows:
        raise DatasetError(f"{path}: the dataset is empty (no non-blank lines)")
    return DatasetRows(rows, source=str(path), line_numbers=line_numbers)


def _load_table(
    path: Path,
    kind: str,
    prompt_key: str,
    answer_key: str | None,
    required_keys: Sequence[str],
    max_rows: int | None,
) -> "DatasetRows":
    """A Parquet file or a ``save_to_disk`` directory: rows of an Arrow table."""
    try:
        import datasets
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(
            f"{path}: reading a {kind} dataset needs the `datasets` library; "
            "pip install 'arealite[data]' (or use a JSONL file)"
        ) from None
    if kind == "Parquet":
        # pyarrow (which datasets brings) reads it directly: datasets' from_parquet would
        # first convert it into an Arrow cache under ~/.cache, once per trainer rank.
        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise DatasetError(f"{path}: not a readable Parquet file ({e})") from None
        columns = table.column_names

        def read(n: int | None) -> list[JsonObject]:
            return (table if n is None else table.slice(0, n)).to_pylist()
    else:
        if not any((path / marker).is_file() for marker in ("state.json", "dataset_dict.json")):
            raise DatasetError(
                f"{path}: a directory, but not one saved by datasets' save_to_disk (no state.json); "
                f"data paths are {FORMATS}"
            )
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if len(ds) != 1:
                raise DatasetError(
                    f"{path}: a DatasetDict with splits {sorted(ds)}; name one split's directory "
                    f"(e.g. {path / sorted(ds)[0]})"
                )
            ds = next(iter(ds.values()))
        columns = ds.column_names

        def read(n: int | None) -> list[JsonObject]:
            return (ds if n is None else ds.select(range(min(n, len(ds))))).to_list()
    for key, field in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key"), *((k, None) for k in required_keys)):
        if key is not None and key not in columns:
            how = f"; set {field}" if field else ""
            raise DatasetError(f"{path}: no column '{key}' (columns: {sorted(columns)}){how}")
    check = _RowChecker(prompt_key, answer_key, required_keys)
    rows = [check(_drop_nulls(row), f"{path} row {i}", i) for i, row in enumerate(read(max_rows))]
    if not rows:
        raise DatasetError(f"{path}: the dataset is empty (no rows)")
    return DatasetRows(rows, source=str(path), line_numbers=range(len(rows)), unit="row")


def _drop_nulls(row: JsonObject) -> JsonObject:
    # A table has every column in every row; a null stands for a field the row does not have.
    return {k: v for k, v in row.items() if v is not None}


class DatasetRows(list):
    """The rows of a file, remembering where each came from so that later checks can name it.

    ``line_numbers[i]`` is row ``i``'s line in a JSONL file, or its index in a
    table (``unit="row"``: Parquet, saved datasets).
    """

    def __init__(self, rows: Sequence[JsonObject] = (), source: str | None = None,
                 line_numbers: Iterable[int] | None = None, unit: str = "line"):
        super().__init__(rows)
        self.source = source
        self.line_numbers = list(line_numbers) if line_numbers is not None else None
        self.unit = unit

    def __getitem__(self, index):
        if isinstance(index, slice):  # `rows[:n]` keeps the line numbers of the rows it keeps
            lines = self.line_numbers[index] if self.line_numbers is not None else None
            return DatasetRows(super().__getitem__(index), self.source, lines, self.unit)
        return super().__getitem__(index)

    def where(self, i: int) -> str:
        """``path:line`` (or ``path row N``) of row ``i`` when known, else ``row i``."""
        if self.source and self.line_numbers is not None:
            sep = ":" if self.unit == "line" else " row "
            return f"{self.source}{sep}{self.line_numbers[i]}"
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
        items: Sequence[JsonObject],
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

    def __iter__(self) -> Iterator[list[JsonObject]]:
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
