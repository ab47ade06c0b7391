"""Resuming reads checkpoint files without running code they could name."""

from __future__ import annotations

import os

import pytest
import torch

from arealite.utils.accounting import EpochItem, epoch_items_from_plain, epoch_items_to_plain
from arealite.trainer.checkpoint import load_state_file


class _Planted:
    """What an attacker with write access to the run directory would leave: unpickling it runs code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_a_planted_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    part = tmp_path / "rollout_rank0.pt"
    torch.save({"step": 3, "controller": {"x": _Planted(str(marker))}}, part)
    with pytest.raises(RuntimeError, match=r"rollout_rank0\.pt holds objects other than tensors.*recover\.allow_pickle"):
        load_state_file(part)
    assert not marker.exists()
    load_state_file(part, allow_pickle=True)  # the operator's explicit opt-in for a trusted directory
    assert marker.exists()


def test_rollout_state_with_epoch_items_round_trips_as_plain_data(tmp_path):
    items = [EpochItem({"prompt": "reverse 12", "answer": "21", "prompt_id": 4}, epoch=2), {"plain": 1}]
    state = {"controller": {"pending_items": items, "ready": [({"input_ids": torch.arange(3)}, items[0])]},
             "step": 7, "pair": (1, "a")}
    part = tmp_path / "s.pt"
    torch.save(epoch_items_to_plain(state), part)
    back = epoch_items_from_plain(load_state_file(part))  # weights_only: no class is named in the file
    first = back["controller"]["pending_items"][0]
    assert isinstance(first, EpochItem) and first.epoch == 2 and dict(first) == dict(items[0])
    assert back["controller"]["pending_items"][1] == {"plain": 1} and back["pair"] == (1, "a")
    td_dict, item = back["controller"]["ready"][0]
    assert torch.equal(td_dict["input_ids"], torch.arange(3)) and item.epoch == 2
