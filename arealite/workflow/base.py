"""The user-facing extension point: how one dataset item becomes trajectories.

A workflow is one coroutine, ``arun_episode(client, item)``, that calls the
inference client as often as it likes (n samples, several turns, tools),
computes rewards and returns one flat TensorDict (see
``arealite.api.types.TRAJECTORY_KEYS``), or ``None`` to reject the item.
The controller runs many of them at once on its event loop; a workflow must
therefore never block: slow Python (a reward function) goes to a worker thread
through ``arealite.reward.pool.RewardRunner``.

The builders below turn token pieces into that TensorDict: ``trajectory_row``
and ``pad_and_stack`` for any conversation, ``group_from_outputs`` for the
common single-turn group (n samples of one prompt; the same result, built by
the hot-path code in ``arealite.workflow.fast_group``), ``concat_trajectories``
to join groups of different lengths.
"""

from __future__ import annotations

import itertools
import os
from typing import Sequence

import torch
from tensordict import TensorDict

from arealite.api.contracts import InferenceClient
from arealite.utils.json_types import JsonObject
from arealite.workflow.fast_group import GroupBuffers, batch_from_buffers, single_turn_group, unchecked_tensordict

#: What a workflow hands the controller for one item: a TensorDict, or a group still in its buffers.
TrajectoryGroup = TensorDict | GroupBuffers


class RolloutWorkflow:
    """Base class of workflows; subclasses implement ``arun_episode``.

    Named in config (``rollout.workflow: mypkg.mod:MyWorkflow``), a workflow is
    built by keyword: its constructor asks, by parameter name, for any of
    ``tokenizer``, ``generation`` (``GenerationConfig``), ``rollout``
    (``RolloutConfig``) and ``reward_fn`` (``data.reward_fn``, loaded), and takes
    its own settings from ``rollout.workflow_kwargs``::

        def __init__(self, *, tokenizer, generation, rollout, reward_fn, max_turns: int = 2): ...

    A workflow that needs more of the config defines
    ``from_config(cls, cfg, tokenizer, **workflow_kwargs)`` instead (see
    ``arealite.workflow.registry``; docs/write_a_workflow.md walks through one).
    """

    async def arun_episode(self, client: InferenceClient, item: JsonObject) -> TensorDict | None:
        """Turn one dataset item into a TensorDict of trajectories, or ``None`` to reject it."""
        raise NotImplementedError

    async def arun_group(self, client: InferenceClient, item: JsonObject) -> TrajectoryGroup | None:
        """What the controller calls: `arun_episode`. A workflow may instead return its group
        still in buffers (`GroupBuffers`), whose tensors the controller then builds with the
        rest of the batch at once (`RLVRWorkflow` does)."""
        return await self.arun_episode(client, item)

    def stats(self) -> dict[str, int]:
        """Counters the controller folds into its stats (reward errors, ...)."""
        return {}


# Group ids must be unique within a training batch even when one prompt is
# sampled twice (two epochs in one prepare_batch window), so they come from a
# process-wide counter, offset per process so ranks do not collide either.
_GROUP_IDS = itertools.count((os.getpid() % 65536) << 40)


def new_group_id() -> int:
    """A fresh int64 group id, unique within this process."""
    return next(_GROUP_IDS)


def trajectory_row(
    prompt_ids: Sequence[int],
    pieces: Sequence[tuple[Sequence[int], Sequence[float] | None, Sequence[int] | None]] = (),
) -> dict[str, torch.Tensor]:
    """Build the per-token tensors of one sequence from its pieces.

    ``prompt_ids`` and pieces whose logprobs are ``None`` (user turns, tool
    output) get ``loss_mask`` False, logprob 0 and version -1; generated pieces
    ``(ids, logprobs, versions)`` get ``loss_mask`` True and their own values.
    """
    ids = list(prompt_ids)
    loss_mask = [False] * len(ids)
    logprobs = [0.0] * len(ids)
    versions = [-1] * len(ids)
    for p_ids, p_lp, p_ver in pieces:
        n = len(p_ids)
        ids.extend(p_ids)
        if p_lp is None:  # context: not trained on
            loss_mask += [False] * n
            logprobs += [0.0] * n
            versions += [-1] * n
            continue
        if len(p_lp) != n or p_ver is None or len(p_ver) != n:
            raise ValueError(
                f"generated piece has {n} tokens but {len(p_lp)} logprobs and "
                f"{None if p_ver is None else len(p_ver)} versions; the client must return one of each per token"
            )
        loss_mask += [True] * n
        logprobs.extend(p_lp)
        versions.extend(p_ver)
    return {
        "input_ids": torch.tensor(ids, dtype=torch.int64),
        "attention_mask": torch.ones(len(ids), dtype=torch.bool),
        "loss_mask": torch.tensor(loss_mask, dtype=torch.bool),
        "logprobs": torch.tensor(logprobs, dtype=torch.float32),
        "versions": torch.tensor(versions, dtype=torch.int64),
    }


#: Right-padding value of each per-token key (any other key pads with 0).
PAD_VALUES: dict[str, float | int | bool] = {
    "input_ids": 0,
    "attention_mask": False,
    "loss_mask": False,
    "logprobs": 0.0,
    "versions": -1,
    "routed_experts": -1,  # no server routing (arealite.moe.trajectory)
}


def pad_and_stack(rows: Sequence[dict[str, torch.Tensor]], per_row: dict[str, torch.Tensor] | None = None) -> TensorDict:
    """Right-pad the rows' tensors along their first dim and stack them into ``[B, L, ...]``.

    Per-token keys (1-D, length L of the row) pad to the longest row with ``PAD_VALUES``; a
    key of more dims pads the same way along its first (a row's images' ``pixel_values``
    ``[P, D]`` to ``[B, max P, D]``, with 0).
    """
    if not rows:
        raise ValueError("pad_and_stack needs at least one row")
    out: dict[str, torch.Tensor] = {}
    for key in rows[0]:
        ts = [r[key] for r in rows]
        if len(ts) == 1:
            out[key] = ts[0].unsqueeze(0)
        elif all(t.shape == ts[0].shape for t in ts):  # the common case (equal lengths): no padding
            out[key] = torch.stack(ts)
        else:
            longest = max(t.shape[0] for t in ts)
            out[key] = torch.full((len(ts), longest, *ts[0].shape[1:]), PAD_VALUES.get(key, 0), dtype=ts[0].dtype)
            for i, t in enumerate(ts):
                out[key][i, : t.shape[0]] = t
    out.update(per_row or {})
    return TensorDict(out, batch_size=[len(rows)])


def group_from_outputs(
    prompt_ids: Sequence[int],
    outputs: Sequence[tuple[Sequence[int], Sequence[float], Sequence[int]]],
    per_row: dict[str, torch.Tensor],
) -> TensorDict:
    """The ``[n, L]`` trajectory of n single-turn samples ``prompt + output_i`` (right-padded).

    ``outputs[i]`` is ``(ids, logprobs, versions)`` of sample i. The result is
    ``pad_and_stack([trajectory_row(prompt_ids, [o]) for o in outputs], per_row)``;
    as this runs once per group on the rollout hot path, it is built by the
    faster ``arealite.workflow.fast_group`` (same tensors, fewer steps).
    """
    return single_turn_group(prompt_ids, outputs, per_row)


def concat_trajectories(tds: Sequence[TrajectoryGroup]) -> TensorDict:
    """Concatenate trajectory TensorDicts of different lengths along the batch.

    Groups still in their buffers (`GroupBuffers`) are built as one batch (`batch_from_buffers`)
    when all parts are; mixed with TensorDicts, each becomes its own TensorDict first.

    Every key of two or more dims is right-padded along dim 1 to the largest across the parts:
    per-token keys (``[B, L, ...]``, L the width of ``input_ids``) to the longest L with
    ``PAD_VALUES``, others (a vision run's ``pixel_values`` ``[B, P, D]`` and
    ``image_grid_thw`` ``[B, N, 3]``) to the most patches / images with 0; 1-D per-row
    keys are concatenated as they are.
    """
    if not tds:
        raise ValueError("concat_trajectories needs at least one TensorDict")
    buffered = [isinstance(td, GroupBuffers) for td in tds]
    if all(buffered):
        return batch_from_buffers(tds)
    if any(buffered):
        tds = [td.to_tensordict() if b else td for td, b in zip(tds, buffered)]
    if len(tds) == 1:
        return tds[0]
    dicts = [dict(td.items()) for td in tds]
    keys = dicts[0].keys()
    for i, d in enumerate(dicts[1:], 1):
        if d.keys() != keys:
            raise ValueError(
                f"trajectory {i} has keys {sorted(d)}, trajectory 0 has {sorted(keys)}; "
                "all trajectories of one batch need the same keys"
            )
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        parts = [d[key] for d in dicts]
        if parts[0].dim() >= 2:
            widths = [t.shape[1] for t in parts]
            widest = max(widths)
            if widest != min(widths):  # the same width (a fixed-length benchmark): no pass over the parts
                parts = [t if t.shape[1] == widest else torch.cat(
                    [t, torch.full((t.shape[0], widest - t.shape[1], *t.shape[2:]), PAD_VALUES.get(key, 0),
                                   dtype=t.dtype)], dim=1) for t in parts]
        out[key] = torch.cat(parts, dim=0)
    # Every part is a TensorDict, so each key's rows are its batch: no constructor checks needed.
    return unchecked_tensordict(out, out["input_ids"].shape[0])


def reject_equal_rewards(td: TensorDict) -> bool:
    """Dynamic sampling filter: accept a group only if its rewards are not all equal.

    A group whose samples all got the same reward has zero GRPO advantage and
    teaches nothing; rejecting it frees its slot for another prompt.
    """
    r = td["rewards"]
    return bool(r.numel() > 1 and not torch.all(r == r[0]))


def __getattr__(name: str) -> object:
    # The reward thread pool used to live here; old imports keep working.
    if name in ("RewardRunner", "RewardError"):
        from arealite.reward import pool

        return getattr(pool, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
