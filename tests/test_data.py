"""JSONL loading with validation, and the stateful sharded dataloader."""

from __future__ import annotations

import json

import pytest

from arealite.data.dataset import DatasetError, StatefulDataLoader, load_jsonl


def write(tmp_path, rows, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return p


def test_load_jsonl_assigns_stable_prompt_ids(tmp_path):
    p = write(tmp_path, [{"prompt": "a", "answer": 1}, "", {"prompt": [{"role": "user", "content": "b"}], "answer": "2"}])
    rows = load_jsonl(p)
    assert [r["prompt_id"] for r in rows] == [0, 1]
    assert rows[1]["prompt"][0]["content"] == "b"
    rows = load_jsonl(write(tmp_path, [{"q": "a", "sol": 7}]), prompt_key="q", answer_key="sol")
    assert rows[0]["answer"] == 7  # reward functions receive `answer`


@pytest.mark.parametrize(
    "rows, match",
    [
        ([{"prompt": "a", "answer": 1}, {"answer": 2}], r"d.jsonl:2: missing field 'prompt'"),
        ([{"prompt": "a"}], r":1: missing field 'answer'"),
        ([{"prompt": 5, "answer": 1}], r"field 'prompt' must be a non-empty string"),
        ([{"prompt": "a", "answer": [1]}], r"field 'answer' must be a string or a number"),
        ([{"prompt": [{"role": "user"}], "answer": 1}], r"field 'prompt'\[0\] must be a message"),
        (['{"prompt": "a", '], r":1: not valid JSON"),
        (["[1, 2]"], r"must be a JSON object"),
        ([{"prompt": "a", "answer": 1, "prompt_id": 0}, {"prompt": "b", "answer": 1, "prompt_id": 0}], "already used"),
        ([""], "empty"),
    ],
)
def test_load_jsonl_errors_name_row_and_field(tmp_path, rows, match):
    with pytest.raises(DatasetError, match=match):
        load_jsonl(write(tmp_path, rows))


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        load_jsonl(tmp_path / "nope.jsonl")


def drain(loader, n):
    """The next n batches, across epochs, as a training loop pulls them."""
    out = []
    while len(out) < n:
        for batch in loader:
            out.append(batch)
            if len(out) == n:
                break
    return out


def test_epochs_reshuffle_deterministically_and_cover_everything():
    items = list(range(10))
    a = StatefulDataLoader(items, batch_size=5, shuffle=True, seed=3)
    b = StatefulDataLoader(items, batch_size=5, shuffle=True, seed=3)
    ea, eb = [x for batch in a for x in batch], [x for batch in b for x in batch]
    assert ea == eb and sorted(ea) == items
    e2 = [x for batch in a for x in batch]
    assert sorted(e2) == items and e2 != ea  # a new order in epoch 1
    assert [x for batch in StatefulDataLoader(items, 5, seed=4) for x in batch] != ea


def test_ranks_get_disjoint_equal_shards():
    items = list(range(11))
    shards = [[x for b in StatefulDataLoader(items, 2, seed=0, rank=r, world_size=3) for x in b] for r in range(3)]
    assert all(len(s) == 2 for s in shards)  # 11 // 3 = 3 per rank, 1 batch of 2 with drop_last
    flat = [x for s in shards for x in s]
    assert len(set(flat)) == len(flat)
    padded = [[x for b in StatefulDataLoader(items, 2, seed=0, rank=r, world_size=3, drop_last=False) for x in b] for r in range(3)]
    assert all(len(s) == 4 for s in padded)
    assert set(x for s in padded for x in s) == set(items)


def test_resume_continues_exactly():
    items = list(range(17))
    ref = StatefulDataLoader(items, 3, seed=9)
    expected = drain(ref, 4) + drain(ref, 4)  # crosses into epoch 1 (5 batches per epoch)
    run = StatefulDataLoader(items, 3, seed=9)
    got = drain(run, 3)
    state = run.state_dict()
    resumed = StatefulDataLoader(items, 3, seed=9)
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.index) == (0, 3)
    got += drain(resumed, 5)  # the rest of epoch 0, then epoch 1
    assert got == expected


def test_resume_with_other_settings_is_refused():
    state = StatefulDataLoader(list(range(10)), 2, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        StatefulDataLoader(list(range(10)), 2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="n_items"):
        StatefulDataLoader(list(range(12)), 2, seed=1).load_state_dict(state)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(items=[], batch_size=1), "empty"),
        (dict(items=[1], batch_size=0), "batch_size"),
        (dict(items=[1, 2], batch_size=1, rank=2, world_size=2), "rank"),
        (dict(items=[1, 2, 3], batch_size=4), "no full batch"),
    ],
)
def test_bad_loader_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StatefulDataLoader(**kwargs)
