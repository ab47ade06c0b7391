"""The user-facing extension point: how one dataset item becomes trajectories.

A workflow is one coroutine, ``arun_episode(engine, item)``, that calls the
inference engine as often as it likes (n samples, several turns, tools),
computes rewards and returns one flat TensorDict (see
``arealite.api.types.TRAJECTORY_KEYS``), or ``None`` to reject the item.
The controller runs many of them at once on its event loop; a workflow must
therefore never block: slow Python (a reward function) goes to a thread with
``run_reward``.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import threading
from typing import Any, Callable, Protocol, Sequence

import torch
from tensordict import TensorDict


class InferenceEngine(Protocol):
    """What a workflow needs from an engine: ``RemoteSGLangEngine`` or a test fake."""

    async def agenerate(self, req: Any) -> Any: ...


class RolloutWorkflow:
    """Base class of workflows; subclasses implement ``arun_episode``."""

    async def arun_episode(self, engine: InferenceEngine, item: dict[str, Any]) -> TensorDict | None:
        """Turn one dataset item into a TensorDict of trajectories, or ``None`` to reject it."""
        raise NotImplementedError

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
    ids: list[int] = list(prompt_ids)
    lp: list[float] = [0.0] * len(ids)
    ver: list[int] = [-1] * len(ids)
    mask: list[bool] = [False] * len(ids)
    for p_ids, p_lp, p_ver in pieces:
        n = len(p_ids)
        ids.extend(int(t) for t in p_ids)
        if p_lp is None:
            lp.extend([0.0] * n)
            ver.extend([-1] * n)
            mask.extend([False] * n)
        else:
            if len(p_lp) != n or p_ver is None or len(p_ver) != n:
                raise ValueError(
                    f"generated piece has {n} tokens but {len(p_lp)} logprobs and "
                    f"{None if p_ver is None else len(p_ver)} versions; the engine must return one of each per token"
                )
            lp.extend(float(x) for x in p_lp)
            ver.extend(int(v) for v in p_ver)
            mask.extend([True] * n)
    return {
        "input_ids": torch.tensor(ids, dtype=torch.int64),
        "attention_mask": torch.ones(len(ids), dtype=torch.bool),
        "loss_mask": torch.tensor(mask, dtype=torch.bool),
        "logprobs": torch.tensor(lp, dtype=torch.float32),
        "versions": torch.tensor(ver, dtype=torch.int64),
    }


#: Right-padding value of each per-token key (any other key pads with 0).
PAD_VALUES: dict[str, float | int | bool] = {
    "input_ids": 0,
    "attention_mask": False,
    "loss_mask": False,
    "logprobs": 0.0,
    "versions": -1,
}


def pad_and_stack(rows: Sequence[dict[str, torch.Tensor]], per_row: dict[str, torch.Tensor] | None = None) -> TensorDict:
    """Right-pad 1-D per-token rows to the longest and stack them into ``[B, L]``."""
    if not rows:
        raise ValueError("pad_and_stack needs at least one row")
    L = max(r["input_ids"].shape[0] for r in rows)
    out: dict[str, torch.Tensor] = {}
    for key in rows[0]:
        pad = PAD_VALUES.get(key, 0)
        t0 = rows[0][key]
        out[key] = torch.full((len(rows), L), pad, dtype=t0.dtype)
        for i, r in enumerate(rows):
            out[key][i, : r[key].shape[0]] = r[key]
    out.update(per_row or {})
    return TensorDict(out, batch_size=[len(rows)])


def concat_trajectories(tds: Sequence[TensorDict]) -> TensorDict:
    """Concatenate trajectory TensorDicts of different lengths along the batch.

    Per-token keys (``[B, L]`` with L the width of ``input_ids``) are right-padded
    to the longest L with ``PAD_VALUES``; per-row keys are concatenated as they are.
    """
    if not tds:
        raise ValueError("concat_trajectories needs at least one TensorDict")
    L = max(td["input_ids"].shape[1] for td in tds)
    keys = list(tds[0].keys())
    for i, td in enumerate(tds[1:], 1):
        if set(td.keys()) != set(keys):
            raise ValueError(
                f"trajectory {i} has keys {sorted(td.keys())}, trajectory 0 has {sorted(keys)}; "
                "all trajectories of one batch need the same keys"
            )
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        parts = []
        for td in tds:
            t = td.get(key)
            width = td["input_ids"].shape[1]
            if t.dim() >= 2 and t.shape[1] == width and width < L:
                pad_shape = (t.shape[0], L - width, *t.shape[2:])
                t = torch.cat([t, torch.full(pad_shape, PAD_VALUES.get(key, 0), dtype=t.dtype)], dim=1)
            parts.append(t)
        out[key] = torch.cat(parts, dim=0)
    return TensorDict(out, batch_size=[sum(td.batch_size[0] for td in tds)])


def reject_equal_rewards(td: TensorDict) -> bool:
    """Dynamic sampling filter: accept a group only if its rewards are not all equal.

    A group whose samples all got the same reward has zero GRPO advantage and
    teaches nothing; rejecting it frees its slot for another prompt.
    """
    r = td["rewards"]
    return bool(r.numel() > 1 and not torch.all(r == r[0]))


class RewardError(RuntimeError):
    """A reward function raised, timed out or returned a non-number."""


class RewardRunner:
    """Runs synchronous reward functions off the event loop, with a timeout.

    Each call gets its own daemon thread (bounded to ``workers`` at once): a
    reward function that hangs forever is abandoned after ``timeout_s`` and
    frees its slot, and can neither block the loop, starve later calls, nor
    keep the interpreter from exiting.
    """

    def __init__(self, timeout_s: float = 15.0, workers: int = 2):
        if timeout_s <= 0:
            raise ValueError(f"reward timeout_s must be > 0, got {timeout_s}")
        if workers < 1:
            raise ValueError(f"reward workers must be >= 1, got {workers}")
        self.timeout_s = timeout_s
        self.workers = workers
        self.abandoned_threads = 0
        self._sems: dict[int, asyncio.Semaphore] = {}

    def _sem(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        sem = self._sems.get(id(loop))
        if sem is None:
            sem = self._sems[id(loop)] = asyncio.Semaphore(self.workers)
        return sem

    async def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
        """``float(fn(*args, **kwargs))`` in a thread; raises ``RewardError`` on any failure."""
        loop = asyncio.get_running_loop()
        async with self._sem():
            fut: asyncio.Future = loop.create_future()

            def _set(ok: bool, value: Any) -> None:
                if not fut.done():
                    (fut.set_result if ok else fut.set_exception)(value)

            def _target() -> None:
                try:
                    value = fn(*args, **kwargs)
                    ok = True
                except BaseException as e:  # reported to the workflow, never lost
                    value, ok = e, False
                try:
                    loop.call_soon_threadsafe(_set, ok, value)
                except RuntimeError:  # the loop closed meanwhile: nobody waits any more
                    pass

            threading.Thread(target=_target, name="arealite-reward", daemon=True).start()
            try:
                value = await asyncio.wait_for(fut, self.timeout_s)
            except asyncio.TimeoutError:
                self.abandoned_threads += 1
                raise RewardError(
                    f"reward function {getattr(fn, '__name__', fn)!r} did not return within "
                    f"{self.timeout_s}s (rollout.reward_timeout_s)"
                ) from None
            except Exception as e:
                raise RewardError(f"reward function {getattr(fn, '__name__', fn)!r} raised {e!r}") from e
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (int, float)) and not (isinstance(value, torch.Tensor) and value.numel() == 1):
            raise RewardError(
                f"reward function {getattr(fn, '__name__', fn)!r} returned {type(value).__name__} "
                f"({value!r:.80}); it must return a float"
            )
        value = float(value)
        if not math.isfinite(value):
            raise RewardError(f"reward function {getattr(fn, '__name__', fn)!r} returned {value}")
        return value
