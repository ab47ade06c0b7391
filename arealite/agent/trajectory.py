"""An episode's recorded LLM calls -> trajectory rows and their rewards.

Two shapes (``rows``):

- ``call``: one row per LLM call: its prompt (loss mask 0: the conversation so far,
  earlier replies included) and its sampled tokens (loss mask 1).
- ``conversation``: one row per linear conversation. Calls chain through ``parent``
  (a call whose prompt is an earlier call's prompt and reply plus new messages); each
  call nobody continues ends a conversation, whose row is its chain: every sampled reply
  with loss mask 1, the messages between them with 0. A reply shared by two
  conversations (the agent branched) is trained on in the first row only.

Rewards: the episode's reward ``R`` (what the agent returned) and per-call rewards
``r_i`` (``call_rewards``). With ``stepwise`` every row of the episode carries
``R + sum(r_i)`` and rows share ``traj_id`` (the trainer's step-wise advantage: one
advantage per episode, given to all its rows). Without it each row gets the discounted
return of its first trained call, ``G_i = r_i + [i ends a conversation] R + gamma G_next``
(next: the call's last continuation), and rows are advantaged on their own.

MoE routing replay: when the calls carry the server's routing, the rows get the
``routed_experts`` key (`with_routed_experts`), laid out as in the other workflows.
"""

from __future__ import annotations

from typing import Sequence

import torch
from tensordict import TensorDict

from arealite.agent.session import LLMCall
from arealite.moe.trajectory import ROUTED_EXPERTS_KEY, place_routed_experts
from arealite.workflow.base import trajectory_row

__all__ = ["episode_rows", "call_returns", "with_routed_experts"]

Row = dict[str, torch.Tensor]


def _children(calls: Sequence[LLMCall]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {c.index: [] for c in calls}
    for c in calls:
        if c.parent is not None and c.parent in out:
            out[c.parent].append(c.index)
    return out


def call_returns(calls: Sequence[LLMCall], reward: float, gamma: float) -> dict[int, float]:
    """``G_i`` of every call (see the module docstring)."""
    kids = _children(calls)
    out: dict[int, float] = {}
    for c in sorted(calls, key=lambda c: -c.index):  # children have larger indices than parents
        g = c.reward or 0.0
        if kids[c.index]:
            g += gamma * out[kids[c.index][-1]]
        else:
            g += reward
        out[c.index] = g
    return out


def _chain(leaf: LLMCall, by_index: dict[int, LLMCall]) -> list[LLMCall]:
    path = [leaf]
    while path[-1].parent is not None and path[-1].parent in by_index:
        path.append(by_index[path[-1].parent])
    return path[::-1]


def _check_chain(path: list[LLMCall]) -> None:
    """Each call of ``path`` continues the one before token-exactly (its prompt starts with that
    call's prompt and output). Sessions link a call to its parent only when this holds; check
    rather than trust, as a misaligned chain would misplace every token after it."""
    for c, nxt in zip(path, path[1:]):
        done = c.prompt_ids + c.output_ids
        if nxt.prompt_ids[: len(done)] != done:
            raise ValueError(f"call {nxt.index} does not continue call {c.index} token-exactly")


def _conversation_row(path: list[LLMCall], trained: set[int]) -> tuple[Row, int]:
    """The row of one chain, and the index of its first call trained here (-1: none)."""
    _check_chain(path)
    pieces = []
    first = -1
    for k, c in enumerate(path):
        fresh = c.index not in trained
        pieces.append((c.output_ids, c.logprobs, c.versions) if fresh else (c.output_ids, None, None))
        if fresh:
            trained.add(c.index)
            first = c.index if first < 0 else first
        if k + 1 < len(path):
            pieces.append((path[k + 1].prompt_ids[len(c.prompt_ids) + len(c.output_ids):], None, None))
    return trajectory_row(path[0].prompt_ids, pieces), first


def _with_images(row: Row, call: LLMCall) -> Row:
    """A row of a prompt with images carries them as the trainer's forward takes them (a
    continuation keeps its first call's images: sessions continue only without new ones)."""
    if call.vision is not None:
        row["pixel_values"] = call.vision.pixel_values.unsqueeze(0)
        row["image_grid_thw"] = call.vision.image_grid_thw.unsqueeze(0)
    return row


def episode_rows(calls: Sequence[LLMCall], rows: str) -> list[tuple[Row, int, list[LLMCall]]]:
    """``(row, index of the first call trained in it, the calls behind the row)`` for every row;
    rows that train nothing (a branch fully trained elsewhere) are left out. The calls behind a
    row are its chain, in order, the last one ending the row; a ``call`` row's chain is the call
    and those it continues (who first ran its prompt: `with_routed_experts`)."""
    by_index = {c.index: c for c in calls}
    if rows == "call":
        out = []
        for c in calls:
            path = _chain(c, by_index)
            _check_chain(path[-2:])  # each link once: the chain's earlier links are its parents'
            out.append((_with_images(trajectory_row(c.prompt_ids, [(c.output_ids, c.logprobs, c.versions)]), c),
                        c.index, path))
        return out
    kids = _children(calls)
    trained: set[int] = set()
    out = []
    for leaf in calls:
        if kids[leaf.index]:
            continue
        path = _chain(leaf, by_index)
        row, first = _conversation_row(path, trained)
        if first >= 0:
            out.append((_with_images(row, path[0]), first, path))
    return out


def with_routed_experts(td: TensorDict, paths: Sequence[Sequence[LLMCall]]) -> TensorDict:
    """``td`` (rows right-padded, `pad_and_stack`) with the ``routed_experts`` key, row i from the
    calls ``paths[i]`` behind it (`episode_rows`); as it was when a call has no routing (the
    servers were not asked: routing replay off).

    Each call ran its whole prompt forward, so every token of a row, the prompt, the tool and
    user messages and the replies, takes its routing from the first call of the chain that ran
    it, as in the multi-turn workflow (`arealite.moe.trajectory.place_routed_experts`).
    """
    routing = place_routed_experts([[c.routed_experts for c in path] for path in paths],
                                   td["attention_mask"].sum(-1).tolist(), td["input_ids"].shape[1])
    if routing is not None:
        td[ROUTED_EXPERTS_KEY] = routing
    return td
