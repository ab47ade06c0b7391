"""Per-prompt accounting: was every prompt of an epoch trained on exactly once?

The training script tags each item with the epoch it was drawn in (``EpochTagged``)
and writes, in every step's stats record, the prompt ids it trained on
(``rollout/prompt_ids``) and their epochs (``rollout/prompt_epochs``), plus the prompts
rejected or failed since the last step (``rollout/dropped_*``). A run writes a start
record (``run/start_step``) and, when it finishes, an end record with the prompts still
unfinished (in flight or ready) and how many epochs the dataloader fully handed out.

``prompt_accounting(stats.jsonl)`` replays the file, which every run appends to: a
run's start record at step S supersedes all earlier records of steps after S (a
resumed run re-does them; the killed run's later records never happened as far as the
model is concerned), and a later record of the same step replaces an earlier one.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from arealite.utils.json_types import JsonObject

IDS, EPOCHS = "rollout/prompt_ids", "rollout/prompt_epochs"
DROPPED_IDS, DROPPED_EPOCHS = "rollout/dropped_prompt_ids", "rollout/dropped_prompt_epochs"
START = "run/start_step"
END = "run/end_step"
UNFINISHED_IDS, UNFINISHED_EPOCHS = "run/unfinished_prompt_ids", "run/unfinished_prompt_epochs"
EPOCHS_DONE = "data/epochs_handed_out"


class EpochItem(dict):
    """A dataset item (a plain dict to workflows) that remembers the epoch it was drawn in.

    The epoch is an attribute, not a key, so it never reaches reward functions; it
    survives pickling (checkpoints) with the item.
    """

    def __init__(self, item: JsonObject, epoch: int):
        super().__init__(item)
        self.epoch = epoch


_EPOCH_KEY = "__arealite_epoch_item__"


def epoch_items_to_plain(obj: object) -> Any:
    """``obj`` with every `EpochItem` inside dicts, lists and tuples written as a plain dict
    (``{_EPOCH_KEY: epoch, "item": {...}}``), so that a checkpoint holds only plain data and
    loads with ``torch.load(weights_only=True)``. `epoch_items_from_plain` undoes it."""
    if isinstance(obj, EpochItem):
        return {_EPOCH_KEY: obj.epoch, "item": {k: epoch_items_to_plain(v) for k, v in obj.items()}}
    if isinstance(obj, dict):
        return {k: epoch_items_to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(epoch_items_to_plain(v) for v in obj) if type(obj) in (list, tuple) else obj
    return obj


def epoch_items_from_plain(obj: object) -> Any:
    if isinstance(obj, dict):
        if _EPOCH_KEY in obj and set(obj) == {_EPOCH_KEY, "item"}:
            return EpochItem(epoch_items_from_plain(obj["item"]), int(obj[_EPOCH_KEY]))
        return {k: epoch_items_from_plain(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(epoch_items_from_plain(v) for v in obj)
    return obj


def item_epoch(item: Mapping[str, object]) -> int:
    return int(getattr(item, "epoch", -1))


class EpochTagged:
    """Wraps a ``StatefulDataLoader``: yields the same batches, items tagged with their epoch."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self) -> Iterator[list]:
        epoch = self.loader.epoch  # the inner iterator serves this epoch, then moves on
        for batch in self.loader:
            yield [EpochItem(it, epoch) for it in batch]

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

    def epochs_handed_out(self) -> int:
        """Epochs whose every batch has been handed out."""
        return self.loader.epoch + (1 if self.loader.index >= len(self.loader) else 0)


def step_fields(items: Iterable[JsonObject], dropped: Iterable[JsonObject]) -> dict[str, list[int]]:
    """The accounting fields of one step's stats record (this rank's share)."""
    items, dropped = list(items), list(dropped)
    return {
        IDS: [int(it["prompt_id"]) for it in items],
        EPOCHS: [item_epoch(it) for it in items],
        DROPPED_IDS: [int(it["prompt_id"]) for it in dropped],
        DROPPED_EPOCHS: [item_epoch(it) for it in dropped],
    }


def unfinished_fields(controller_state: dict) -> dict[str, list[int]]:
    """Prompts a run leaves unfinished (ready, running, queued, not yet submitted), from ``state_dict()``."""
    items = [it for _, it in controller_state["ready"]] + list(controller_state["pending_items"])
    items += list(controller_state.get("unsubmitted_items", []))
    dropped = list(controller_state.get("dropped_items", []))
    return {
        UNFINISHED_IDS: [int(it["prompt_id"]) for it in items],
        UNFINISHED_EPOCHS: [item_epoch(it) for it in items],
        DROPPED_IDS: [int(it["prompt_id"]) for it in dropped],
        DROPPED_EPOCHS: [item_epoch(it) for it in dropped],
    }


@dataclass
class EpochReport:
    epoch: int
    trained: int  # prompts trained at least once
    missing: list[int] = field(default_factory=list)  # expected, yet trained 0 times (nor dropped/unfinished)
    duplicated: list[int] = field(default_factory=list)  # trained (or trained + dropped/unfinished) > 1 time
    dropped: list[int] = field(default_factory=list)  # rejected or failed: not trained, by design
    unfinished: list[int] = field(default_factory=list)  # still in flight when the last run ended
    handed_out: bool | None = None  # every batch of the epoch left the dataloader (None: unknown)

    @property
    def exact(self) -> bool:
        """Every prompt accounted for exactly once (only meaningful once the epoch is handed out)."""
        return not self.missing and not self.duplicated


@dataclass
class Accounting:
    epochs: dict[int, EpochReport]
    steps: list[int]  # the steps that count, in order
    runs: int  # how many runs wrote to the file
    finished: bool  # the last run wrote its end record


def _records(path: Path) -> Iterator[dict]:
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line torn by a kill
        if isinstance(rec, dict) and "step" in rec:
            yield rec


def prompt_accounting(stats_path: str | Path, expected_ids: Iterable[int] | None = None) -> Accounting:
    """Replay ``stats.jsonl`` and count, per epoch, how often each prompt was trained on.

    ``expected_ids``: the prompt ids every epoch should cover (default: every id seen).
    """
    path = Path(stats_path)
    if not path.is_file():
        raise FileNotFoundError(f"no stats file at {path}")
    steps: dict[int, dict] = {}
    end: dict | None = None
    runs = 0
    for rec in _records(path):
        step = int(rec["step"])
        if START in rec:
            runs += 1
            end = None
            for s in [s for s in steps if s > step]:
                del steps[s]
        if END in rec:
            end = rec
        if IDS in rec:
            if len(rec[IDS]) != len(rec.get(EPOCHS, [])):
                raise ValueError(f"{path}: step {step} has {len(rec[IDS])} prompt ids but "
                                 f"{len(rec.get(EPOCHS, []))} epochs")
            steps[step] = rec

    trained: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    other: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    dropped: dict[int, list[int]] = collections.defaultdict(list)
    unfinished: dict[int, list[int]] = collections.defaultdict(list)
    for rec in steps.values():
        for pid, ep in zip(rec[IDS], rec[EPOCHS]):
            trained[ep][pid] += 1
        for pid, ep in zip(rec.get(DROPPED_IDS, []), rec.get(DROPPED_EPOCHS, [])):
            dropped[ep].append(pid)
            other[ep][pid] += 1
    if end is not None:
        for pid, ep in zip(end.get(UNFINISHED_IDS, []), end.get(UNFINISHED_EPOCHS, [])):
            unfinished[ep].append(pid)
            other[ep][pid] += 1
        for pid, ep in zip(end.get(DROPPED_IDS, []), end.get(DROPPED_EPOCHS, [])):
            dropped[ep].append(pid)
            other[ep][pid] += 1

    all_epochs = sorted(set(trained) | set(dropped) | set(unfinished))
    if expected_ids is None:
        expected = set()
        for ep in all_epochs:
            expected |= set(trained[ep]) | set(dropped[ep]) | set(unfinished[ep])
    else:
        expected = set(int(i) for i in expected_ids)
    handed = None if end is None else int(end.get(EPOCHS_DONE, 0))
    reports = {}
    for ep in all_epochs:
        seen = trained[ep] + other[ep]
        done = None if handed is None else ep < handed
        reports[ep] = EpochReport(
            epoch=ep,
            trained=len(trained[ep]),
            # Prompts not yet drawn in an epoch the loader has not finished are not missing.
            missing=sorted(expected - set(seen)) if done else [],
            duplicated=sorted(p for p, n in seen.items() if n > 1),
            dropped=sorted(dropped[ep]),
            unfinished=sorted(unfinished[ep]),
            handed_out=done,
        )
    return Accounting(epochs=reports, steps=sorted(steps), runs=runs, finished=end is not None)


def main(argv: list[str] | None = None) -> None:
    """``python -m arealite.utils.accounting RUN_DIR/stats.jsonl``: print the per-epoch table."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("stats_path")
    a = p.parse_args(argv)
    acc = prompt_accounting(a.stats_path)
    print(f"{acc.runs} run(s), {len(acc.steps)} steps count, last run finished: {acc.finished}")
    print(f"{'epoch':>5} {'trained':>8} {'missing':>8} {'>1 time':>8} {'dropped':>8} {'unfinished':>10}  handed out")
    for r in acc.epochs.values():
        print(f"{r.epoch:>5} {r.trained:>8} {len(r.missing):>8} {len(r.duplicated):>8} {len(r.dropped):>8} "
              f"{len(r.unfinished):>10}  {r.handed_out}")


if __name__ == "__main__":
    main()
