"""Dataset loading (JSONL, Parquet, saved Hugging Face datasets) with validation, and the
stateful sharded dataloader."""

from __future__ import annotations

import json
import sys

import pytest

from arealite.data.dataset import DatasetError, StatefulDataLoader, load_items, load_jsonl


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


# ------------------------------------------------- Parquet and saved datasets

def write_format(tmp_path, fmt, rows, name="d"):
    """``rows`` written as JSONL, as Parquet, or as a saved dataset directory."""
    if fmt == "jsonl":
        return write(tmp_path, rows, f"{name}.jsonl")
    datasets = pytest.importorskip("datasets")
    if fmt == "parquet":
        path = tmp_path / f"{name}.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        path = tmp_path / name
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def table_rows():
    # One type per column, as a table holds them.
    return [{"q": f"What is {i} + {i}?", "sol": str(2 * i), "level": i % 3} for i in range(5)]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "saved"])
def test_load_items_reads_every_format_alike(tmp_path, fmt):
    rows = load_items(write_format(tmp_path, fmt, table_rows()), prompt_key="q", answer_key="sol")
    assert [r["q"] for r in rows] == [f"What is {i} + {i}?" for i in range(5)]
    assert [r["answer"] for r in rows] == ["0", "2", "4", "6", "8"]  # reward functions receive `answer`
    assert [r["prompt_id"] for r in rows] == [0, 1, 2, 3, 4] and rows[4]["level"] == 1
    assert load_items(write_format(tmp_path, fmt, table_rows(), "again"), "q", "sol") == rows
    assert [r["q"] for r in load_items(write_format(tmp_path, fmt, table_rows(), "few"), "q", "sol", max_rows=2)] == \
        ["What is 0 + 0?", "What is 1 + 1?"]


@pytest.mark.parametrize("fmt", ["parquet", "saved"])
def test_tables_keep_chat_messages_and_prompt_ids(tmp_path, fmt):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    rows = [{"prompt": msgs, "answer": "4", "prompt_id": 10}, {"prompt": msgs[1:], "answer": "5", "prompt_id": 3}]
    items = load_items(write_format(tmp_path, fmt, rows))
    assert [r["prompt"] for r in items] == [msgs, msgs[1:]]
    assert [r["prompt_id"] for r in items] == [10, 3]


@pytest.mark.parametrize("fmt", ["parquet", "saved"])
@pytest.mark.parametrize("rows, match", [
    ([{"prompt": "a", "answer": "1"}, {"prompt": " ", "answer": "2"}], r"row 1: field 'prompt' is an empty string"),
    ([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}], r"row 1: missing field 'answer'"),
    ([{"prompt": "a", "answer": "1", "prompt_id": 4}, {"prompt": "b", "answer": "1", "prompt_id": 4}], "already used"),
    ([{"prompt": [{"role": "user", "content": 3}], "answer": "1"}], r"row 0: field 'prompt'\[0\] must be a message"),
    ([{"prompt": "a", "answer": float("nan")}], r"row 0: field 'answer' is nan"),
], ids=["empty-prompt", "null-answer", "dup-id", "bad-message", "nan-answer"])
def test_table_rows_are_validated_like_jsonl_lines(tmp_path, fmt, rows, match):
    path = write_format(tmp_path, fmt, rows)
    with pytest.raises(DatasetError, match=match) as e:
        load_items(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "saved"])
def test_wrong_key_names_the_file_and_the_key(tmp_path, fmt):
    path = write_format(tmp_path, fmt, table_rows())
    with pytest.raises(DatasetError, match="'question'") as e:
        load_items(path, prompt_key="question", answer_key="sol")
    assert str(path) in str(e.value) and "data.prompt_key" in str(e.value)
    with pytest.raises(DatasetError, match="'solution'.*data.answer_key"):
        load_items(path, prompt_key="q", answer_key="solution")


def test_bad_paths_say_what_is_expected(tmp_path):
    with pytest.raises(DatasetError, match=f"dataset not found: {tmp_path / 'nope.parquet'}.*Parquet"):
        load_items(tmp_path / "nope.parquet")
    (tmp_path / "plain").mkdir()
    with pytest.raises(DatasetError, match="plain: a directory, but not one saved by datasets' save_to_disk"):
        load_items(tmp_path / "plain")
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match="junk.parquet: not a readable Parquet file"):
        load_items(tmp_path / "junk.parquet")


def test_saved_dataset_dict_needs_one_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    one = datasets.Dataset.from_list(table_rows())
    datasets.DatasetDict({"train": one}).save_to_disk(str(tmp_path / "one"))
    assert len(load_items(tmp_path / "one", "q", "sol")) == 5
    datasets.DatasetDict({"train": one, "test": one}).save_to_disk(str(tmp_path / "two"))
    with pytest.raises(DatasetError, match=r"splits \['test', 'train'\]; name one split's directory"):
        load_items(tmp_path / "two", "q", "sol")
    assert len(load_items(tmp_path / "two" / "test", "q", "sol")) == 5


def test_jsonl_needs_no_datasets_library(tmp_path, monkeypatch):
    parquet = write_format(tmp_path, "parquet", table_rows())
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    assert len(load_items(write(tmp_path, table_rows()), "q", "sol")) == 5
    with pytest.raises(DatasetError, match=r"needs the `datasets` library; pip install 'arealite\[data\]'"):
        load_items(parquet, "q", "sol")


def test_later_checks_name_table_rows(tmp_path, micro_model_dir):
    from transformers import AutoTokenizer

    from arealite.data.validate import validate_prompts

    path = write_format(tmp_path, "parquet", [{"prompt": "hi", "answer": "1"}, {"prompt": "x " * 300, "answer": "2"}])
    items = load_items(path)
    assert items.where(1) == f"{path} row 1" and items[1:].where(0) == f"{path} row 1"
    with pytest.raises(DatasetError, match=f"{path} row 1 \\(prompt_id 1\\)"):
        validate_prompts(items, AutoTokenizer.from_pretrained(micro_model_dir), max_prompt_len=50)


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
