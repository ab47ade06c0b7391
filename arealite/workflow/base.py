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
import collections
import itertools
import math
import os
import queue
import threading
import time
from array import array
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


def _int64(values: Sequence[int]) -> torch.Tensor:
    # array -> frombuffer is ~10x faster than torch.tensor(list) for a few hundred ints.
    return torch.frombuffer(array("q", values), dtype=torch.int64) if len(values) else torch.empty(0, dtype=torch.int64)


def trajectory_row(
    prompt_ids: Sequence[int],
    pieces: Sequence[tuple[Sequence[int], Sequence[float] | None, Sequence[int] | None]] = (),
) -> dict[str, torch.Tensor]:
    """Build the per-token tensors of one sequence from its pieces.

    ``prompt_ids`` and pieces whose logprobs are ``None`` (user turns, tool
    output) get ``loss_mask`` False, logprob 0 and version -1; generated pieces
    ``(ids, logprobs, versions)`` get ``loss_mask`` True and their own values.
    """
    ids = array("q", prompt_ids)
    generated: list[tuple[int, int, Sequence[float], Sequence[int]]] = []
    for p_ids, p_lp, p_ver in pieces:
        start = len(ids)
        ids.extend(p_ids)
        if p_lp is not None:
            n = len(ids) - start
            if len(p_lp) != n or p_ver is None or len(p_ver) != n:
                raise ValueError(
                    f"generated piece has {n} tokens but {len(p_lp)} logprobs and "
                    f"{None if p_ver is None else len(p_ver)} versions; the engine must return one of each per token"
                )
            if n:
                generated.append((start, len(ids), p_lp, p_ver))
    L = len(ids)
    loss_mask = torch.zeros(L, dtype=torch.bool)
    logprobs = torch.zeros(L, dtype=torch.float32)
    versions = torch.full((L,), -1, dtype=torch.int64)
    for a, b, lp, ver in generated:
        loss_mask[a:b] = True
        logprobs[a:b] = torch.frombuffer(array("f", lp), dtype=torch.float32)
        versions[a:b] = _int64(ver)
    return {
        "input_ids": _int64(ids),
        "attention_mask": torch.ones(L, dtype=torch.bool),
        "loss_mask": loss_mask,
        "logprobs": logprobs,
        "versions": versions,
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
    lengths = {r["input_ids"].shape[0] for r in rows}
    out: dict[str, torch.Tensor] = {}
    if len(lengths) == 1:  # the common case (one sample, or equal lengths): no padding
        for key in rows[0]:
            out[key] = rows[0][key].unsqueeze(0) if len(rows) == 1 else torch.stack([r[key] for r in rows])
        out.update(per_row or {})
        return TensorDict(out, batch_size=[len(rows)])
    L = max(lengths)
    for key in rows[0]:
        pad = PAD_VALUES.get(key, 0)
        t0 = rows[0][key]
        out[key] = torch.full((len(rows), L), pad, dtype=t0.dtype)
        for i, r in enumerate(rows):
            out[key][i, : r[key].shape[0]] = r[key]
    out.update(per_row or {})
    return TensorDict(out, batch_size=[len(rows)])


def _piece_check(n: int, lps: Sequence[float] | None, vers: Sequence[int] | None) -> None:
    if lps is None or len(lps) != n or vers is None or len(vers) != n:
        raise ValueError(
            f"generated piece has {n} tokens but {None if lps is None else len(lps)} logprobs and "
            f"{None if vers is None else len(vers)} versions; the engine must return one of each per token"
        )


def group_from_outputs(
    prompt_ids: Sequence[int],
    outputs: Sequence[tuple[Sequence[int], Sequence[float], Sequence[int]]],
    per_row: dict[str, torch.Tensor],
) -> TensorDict:
    """The ``[n, L]`` trajectory of n single-turn samples ``prompt + output_i`` (right-padded).

    ``outputs[i]`` is ``(ids, logprobs, versions)`` of sample i. Same result as
    ``pad_and_stack`` over ``trajectory_row``s, but every tensor is built in one
    go from flat Python buffers: several times cheaper on the per-group hot path.
    """
    n, P = len(outputs), len(prompt_ids)
    if n == 1:
        return _single(prompt_ids, P, outputs[0], per_row)
    if n == 0:
        raise ValueError("group_from_outputs needs at least one output")
    lens = [len(o[0]) for o in outputs]
    G = max(lens)
    L = P + G
    prompt = array("q", prompt_ids)
    ids, vers, lps = array("q"), array("q"), array("f")
    prompt_vers, prompt_lps = array("q", [-1]) * P, array("f", bytes(4 * P))
    loss = bytearray()
    for (o_ids, o_lps, o_vers), g in zip(outputs, lens):
        _piece_check(g, o_lps, o_vers)
        pad = G - g
        ids += prompt
        ids.extend(o_ids)
        vers += prompt_vers
        vers.extend(o_vers)
        lps += prompt_lps
        lps.extend(o_lps)
        loss += b"\0" * P + b"\1" * g + b"\0" * pad
        if pad:
            ids.extend(bytes(pad))  # zeros
            vers.extend([-1] * pad)
            lps.extend(bytes(pad))
    if L == 0:
        raise ValueError("group_from_outputs: empty prompt and empty outputs give no tokens")
    shape = (n, L)
    if G == min(lens):
        attention = torch.ones(shape, dtype=torch.bool)
    else:
        attention = torch.frombuffer(
            bytearray(b"".join(b"\1" * (P + g) + b"\0" * (G - g) for g in lens)), dtype=torch.bool
        ).view(shape)
    return _tensordict(
        torch.frombuffer(ids, dtype=torch.int64).view(shape),
        attention,
        torch.frombuffer(loss, dtype=torch.bool).view(shape),
        torch.frombuffer(lps, dtype=torch.float32).view(shape),
        torch.frombuffer(vers, dtype=torch.int64).view(shape),
        per_row,
        n,
    )


def _single(
    prompt_ids: Sequence[int],
    P: int,
    output: tuple[Sequence[int], Sequence[float], Sequence[int]],
    per_row: dict[str, torch.Tensor],
) -> TensorDict:
    # One sample (the common evaluation and n=1 case): no padding, no per-sample loop.
    o_ids, o_lps, o_vers = output
    g = len(o_ids)
    _piece_check(g, o_lps, o_vers)
    L = P + g
    if L == 0:
        raise ValueError("group_from_outputs: empty prompt and empty outputs give no tokens")
    ids = array("q", prompt_ids)
    ids.extend(o_ids)
    vers = _MINUS_ONE * P
    vers.extend(o_vers)
    lps = array("f", bytes(4 * P))
    lps.extend(o_lps)
    return _tensordict(
        torch.frombuffer(ids, dtype=torch.int64)[None],
        torch.frombuffer(bytearray(_ONE * L), dtype=torch.bool)[None],
        torch.frombuffer(bytearray(P) + _ONE * g, dtype=torch.bool)[None],
        torch.frombuffer(lps, dtype=torch.float32)[None],
        torch.frombuffer(vers, dtype=torch.int64)[None],
        per_row,
        1,
    )


_MINUS_ONE = array("q", [-1])
_ONE = b"\1"

#: The per-token keys, in the order ``_tensordict`` takes them.
PER_TOKEN_KEYS = ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions")


def _tensordict(input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                logprobs: torch.Tensor, versions: torch.Tensor, per_row: dict[str, torch.Tensor], n: int) -> TensorDict:
    """The group's TensorDict, marked as well-formed by construction.

    ``validate_trajectory`` skips the per-token checks of a marked group as long
    as those five tensors are still the same objects, unmodified in place
    (``_version`` 0); per-row keys, which come from the caller, are always checked.
    """
    tensors = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
               "logprobs": logprobs, "versions": versions, **per_row}
    # The checked constructor costs ~4 us more; these tensors are consistent by construction.
    fast = getattr(TensorDict, "_new_unsafe", None)
    td = fast(tensors, batch_size=torch.Size([n])) if fast is not None else TensorDict(tensors, batch_size=[n])
    td._arealite_group = (input_ids, attention_mask, loss_mask, logprobs, versions)
    return td


def concat_trajectories(tds: Sequence[TensorDict]) -> TensorDict:
    """Concatenate trajectory TensorDicts of different lengths along the batch.

    Per-token keys (``[B, L]`` with L the width of ``input_ids``) are right-padded
    to the longest L with ``PAD_VALUES``; per-row keys are concatenated as they are.
    """
    if not tds:
        raise ValueError("concat_trajectories needs at least one TensorDict")
    if len(tds) == 1:
        return tds[0]
    dicts = [dict(td.items()) for td in tds]
    keys = set(dicts[0])
    for i, d in enumerate(dicts[1:], 1):
        if set(d) != keys:
            raise ValueError(
                f"trajectory {i} has keys {sorted(d)}, trajectory 0 has {sorted(keys)}; "
                "all trajectories of one batch need the same keys"
            )
    widths = [d["input_ids"].shape[1] for d in dicts]
    L = max(widths)
    out: dict[str, torch.Tensor] = {}
    for key in dicts[0]:
        parts = []
        for d, width in zip(dicts, widths):
            t = d[key]
            if width < L and t.dim() >= 2 and t.shape[1] == width:
                pad_shape = (t.shape[0], L - width, *t.shape[2:])
                t = torch.cat([t, torch.full(pad_shape, PAD_VALUES.get(key, 0), dtype=t.dtype)], dim=1)
            parts.append(t)
        out[key] = torch.cat(parts, dim=0)
    return TensorDict(out, batch_size=[out["input_ids"].shape[0]])


def reject_equal_rewards(td: TensorDict) -> bool:
    """Dynamic sampling filter: accept a group only if its rewards are not all equal.

    A group whose samples all got the same reward has zero GRPO advantage and
    teaches nothing; rejecting it frees its slot for another prompt.
    """
    r = td["rewards"]
    return bool(r.numel() > 1 and not torch.all(r == r[0]))


class RewardError(RuntimeError):
    """A reward function raised, timed out or returned a non-number."""


class _RewardJob:
    """One reward call; ``state`` moves under ``RewardRunner._lock``."""

    __slots__ = ("fn", "args", "kwargs", "fut", "box", "state", "started", "ok", "value")

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, fut: asyncio.Future, box: "_LoopBox"):
        self.fn, self.args, self.kwargs, self.fut, self.box = fn, args, kwargs, fut, box
        self.state = _QUEUED
        self.started = 0.0  # time.monotonic() when a worker took it
        self.ok = False
        self.value: Any = None


# Job states. QUEUED: waiting for a worker; STARTED: running; FINISHED: result posted;
# CANCELLED (before it started) / ABANDONED (timed out while running): nobody waits.
_QUEUED, _STARTED, _FINISHED, _CANCELLED, _ABANDONED = range(5)


class _LoopBox:
    """Per-event-loop state of a ``RewardRunner``: calls in flight, timer, results mailbox."""

    __slots__ = ("loop", "inflight", "timer", "done", "wake_pending")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        # Calls not yet delivered, in submission order (= start order: the job queue is FIFO),
        # so one timer watching the oldest replaces a timer per call.
        self.inflight: collections.OrderedDict[_RewardJob, None] = collections.OrderedDict()
        self.timer: asyncio.TimerHandle | None = None
        self.done: collections.deque[_RewardJob] = collections.deque()  # filled by workers
        self.wake_pending = False


class RewardRunner:
    """Runs synchronous reward functions off the event loop, with a timeout.

    A small pool of daemon worker threads (``workers`` at once) runs the calls
    in submission order. A call that runs longer than ``timeout_s`` (counted
    from when a worker takes it, not from when it was queued) is abandoned:
    its thread is replaced at once and exits when the call finally returns,
    so a reward function that hangs can neither block the loop, starve later
    calls, nor keep the interpreter from exiting. Idle workers exit after
    ``idle_s``.

    Cheap per call, because it runs once per sample on the rollout hot path:
    calls are queued at once (a worker that holds the GIL runs many in a row,
    rather than one per loop round trip), one timer per loop watches the
    oldest call instead of one timer per call, and workers hand results back
    in batches (one loop wake-up pending at a time).
    """

    def __init__(self, timeout_s: float = 15.0, workers: int = 2, idle_s: float = 30.0):
        if timeout_s <= 0:
            raise ValueError(f"reward timeout_s must be > 0, got {timeout_s}")
        if workers < 1:
            raise ValueError(f"reward workers must be >= 1, got {workers}")
        self.timeout_s = timeout_s
        self.workers = workers
        self.idle_s = idle_s
        self.abandoned_threads = 0
        self._boxes: dict[asyncio.AbstractEventLoop, _LoopBox] = {}
        self._last: _LoopBox | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live = 0  # workers not stuck in an abandoned call

    # ---------------------------------------------------------- worker side
    def _worker(self) -> None:
        # Reward calls run side by side on several workers: one intra-op thread each
        # (per-thread setting), so that a torch op in a reward function does not leave
        # an OpenMP team per worker spin-waiting.
        torch.set_num_threads(1)
        lock, jobs, monotonic = self._lock, self._jobs, time.monotonic
        while True:
            try:
                job = jobs.get(timeout=self.idle_s)
            except queue.Empty:
                with lock:
                    if jobs.empty():
                        self._live -= 1
                        return
                continue
            with lock:
                if job.state != _QUEUED:  # cancelled before it started
                    continue
                job.state = _STARTED
                job.started = monotonic()
            try:
                job.value, job.ok = job.fn(*job.args, **job.kwargs), True
            except BaseException as e:  # reported to the workflow, never lost
                job.value, job.ok = e, False
            with lock:
                if job.state == _ABANDONED:
                    return  # a replacement worker was started when this call timed out
                job.state = _FINISHED
            box = job.box
            box.done.append(job)
            # One wake-up covers every result appended before the loop drains (see _drain).
            if not box.wake_pending:
                box.wake_pending = True
                try:
                    box.loop.call_soon_threadsafe(self._drain, box)
                except RuntimeError:  # the loop closed meanwhile: nobody waits any more
                    pass

    def _spawn_workers(self) -> None:
        # caller holds self._lock
        while self._live < self.workers:
            self._live += 1
            threading.Thread(target=self._worker, name="arealite-reward", daemon=True).start()

    # ------------------------------------------------------------ loop side
    def _box(self) -> _LoopBox:
        loop = asyncio.get_running_loop()
        box = self._last
        if box is None or box.loop is not loop:
            box = self._boxes.get(loop)
            if box is None:
                for old in [lp for lp in self._boxes if lp.is_closed()]:
                    del self._boxes[old]
                box = self._boxes[loop] = _LoopBox(loop)
            self._last = box
        return box

    def _drain(self, box: _LoopBox) -> None:
        # Clear the flag first: a result appended after this line schedules a new drain.
        box.wake_pending = False
        done, inflight = box.done, box.inflight
        while done:
            job = done.popleft()
            inflight.pop(job, None)
            if not job.fut.done():
                job.fut.set_result(None)

    def _arm(self, box: _LoopBox, delay: float) -> None:
        box.timer = box.loop.call_later(delay, self._on_timer, box)

    def _on_timer(self, box: _LoopBox) -> None:
        box.timer = None
        inflight = box.inflight
        now = time.monotonic()
        while inflight:
            job = next(iter(inflight))
            with self._lock:
                state = job.state
                if state == _STARTED and now - job.started >= self.timeout_s:
                    job.state = state = _ABANDONED
                    self.abandoned_threads += 1
                    self._live -= 1
                    self._spawn_workers()
            if state == _QUEUED:  # later calls are queued too; look again soon after it starts
                self._arm(box, min(self.timeout_s, 0.05))
                return
            if state == _STARTED:
                self._arm(box, job.started + self.timeout_s - now)
                return
            inflight.pop(job)
            if state == _ABANDONED and not job.fut.done():
                job.fut.set_result(_TIMED_OUT)
            # FINISHED: _drain delivers it; CANCELLED: nobody waits

    def _cancel(self, box: _LoopBox, job: _RewardJob) -> None:
        with self._lock:
            if job.state == _QUEUED:
                job.state = _CANCELLED  # the worker that takes it skips it
        if job.state == _CANCELLED:
            box.inflight.pop(job, None)
        # STARTED: it runs on, and its result is dropped when it arrives

    async def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
        """``float(fn(*args, **kwargs))`` in a worker thread; raises ``RewardError`` on any failure."""
        box = self._box()
        job = _RewardJob(fn, args, kwargs, box.loop.create_future(), box)
        box.inflight[job] = None
        with self._lock:  # with the put, so that an idle worker cannot exit past this job
            if self._live < self.workers:
                self._spawn_workers()
            self._jobs.put(job)
        if box.timer is None:
            self._arm(box, self.timeout_s)
        try:
            result = await job.fut
        except asyncio.CancelledError:
            self._cancel(box, job)
            raise
        if result is _TIMED_OUT:
            raise RewardError(
                f"reward function {_name(fn)!r} did not return within {self.timeout_s}s (rollout.reward_timeout_s)"
            )
        value = job.value
        if not job.ok:
            raise RewardError(f"reward function {_name(fn)!r} raised {value!r}") from value
        if type(value) is float:  # the common case, checked first
            if value - value == 0.0:  # finite: inf - inf and nan - nan are nan
                return value
            raise RewardError(f"reward function {_name(fn)!r} returned {value}")
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (int, float)) and not (isinstance(value, torch.Tensor) and value.numel() == 1):
            raise RewardError(f"reward function {_name(fn)!r} returned {type(value).__name__} ({value!r:.80}); it must return a float")
        value = float(value)
        if not math.isfinite(value):
            raise RewardError(f"reward function {_name(fn)!r} returned {value}")
        return value


_TIMED_OUT = object()


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", repr(fn))
