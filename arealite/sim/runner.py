"""A model runner that computes nothing: continuous batching timed by a GPU cost model.

It takes `ModelRunner`'s place behind the embedded server's routes (a `GenerationRunner`;
``python -m arealite.sim``), so that the client, the controller and the weight publisher
meet the same HTTP protocol, strict mode, pauses, aborts and weight routes as with a
real server, while the time each request takes is what `SimSpec` says one GPU server
would take. It runs on the server's event loop (no thread), so one process serves many.

Scheduling, as SGLang's: requests wait in arrival order; one is admitted while the
batch has a free row and the KV cache room for its prompt and its answer (the answer's
length is drawn at admission, so the cache never runs out; only a ``retract`` pause puts
running sequences back in the queue, and their next prefill recomputes prompt and answer so far); the admitted ones run one
prefill, which yields their first token; then the batch decodes. Between two events
(a sequence finishes, a request arrives, a command) the batch does not change, so the
runner sleeps through all those decode steps at once (`SimSpec.steps_s`) and, woken
early, counts the steps that fitted (`SimSpec.steps_within`); tokens are made only
when a sequence returns.

Outputs are deterministic: a sequence's length, token ids and log-probs come from a
generator seeded by the server's seed, its prompt and (unless greedy) its arrival
number or ``sampling_seed``; a response shorter than ``max_new_tokens`` ends with an
EOS token (finish reason ``stop``), unless ``ignore_eos``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import numpy as np

from arealite.server.generate_request import GenerateInput
from arealite.server.runner_contract import PauseState, Sequence, record_version_change

from .cost_model import SimSpec

logger = logging.getLogger("arealite.sim")

T = TypeVar("T")

__all__ = ["SimRunner", "sim_runner_class"]


class PrefixCache:
    """Which prompts are cached (SGLang's radix cache, by whole prompt): a hit skips the
    prompt's prefill but its last token. Cleared on every command, as `ModelRunner` does."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.keys: OrderedDict[bytes, None] = OrderedDict()
        self.hits = self.misses = 0

    def seen(self, key: bytes) -> bool:
        """Whether ``key`` was cached (and remember it now)."""
        if self.capacity <= 0:
            return False
        hit = key in self.keys
        self.hits += hit
        self.misses += not hit
        self.keys[key] = None
        self.keys.move_to_end(key)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)
        return hit

    def clear(self) -> int:
        n = len(self.keys)
        self.keys.clear()
        return n

    def __len__(self) -> int:
        return len(self.keys)


@dataclass
class SimSequence(Sequence):
    """A request in the simulated engine: a `Sequence` that knows its draw."""

    draw: int | None = None
    """What, besides the server's seed and the prompt, seeds its length and tokens:
    ``sampling_seed``, else its arrival number, else (greedy) nothing."""
    stops: frozenset[int] = field(default_factory=frozenset)
    resume: _Running | None = None
    """Its place in the batch when a ``retract`` pause put it back in the queue (tokens made so far)."""


@dataclass
class _Running:
    """A sequence in the batch: how many tokens it will make, how many it made."""

    seq: Sequence
    target: int
    stops: bool
    """Whether it ends on an EOS token (else at ``max_new_tokens``)."""
    made: int = 0

    @property
    def left(self) -> int:
        return self.target - self.made


def _key(*parts: object) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


class SimRunner:
    """A `GenerationRunner` driven by `SimSpec` (see the module's docstring)."""

    def __init__(self, model: object = None, *, spec: SimSpec, eos_ids: set[int], vocab_size: int,
                 max_batch_size: int, random_seed: int, weight_version: str, prompt_cache_entries: int = 0,
                 arrivals: list[tuple[str, float]] | None = None, **_unused: object):
        """``arrivals``: when given, each request's ``(rid, wall-clock time)`` is appended on
        arrival (``--sim-trace``: benchmarks compare it with the client's send times)."""
        self.spec = spec
        self.eos_ids = frozenset(eos_ids)
        self.eos = min(eos_ids) if eos_ids else None
        self.vocab_size = vocab_size
        self.max_batch_size = max_batch_size
        self.seed = random_seed
        self._weight_version = weight_version
        self.pause = PauseState()
        self.lora = None  # set by the LoRA routes; adapters change nothing here
        self.prompt_cache = PrefixCache(prompt_cache_entries)
        self.kv_capacity = spec.kv_capacity_tokens
        self.stats = {"steps": 0, "prefills": 0, "generated_tokens": 0, "max_running": 0, "sim_busy_s": 0.0,
                      "sim_transfer_s": 0.0, "kv_tokens": 0, "kv_capacity_tokens": self.kv_capacity}
        self._waiting: deque[Sequence] = deque()
        self._running: list[_Running] = []
        self._kv_reserved = 0
        self._arrivals = 0
        self._holds = 0
        self._wake: asyncio.Event | None = None
        self._settled: asyncio.Event | None = None  # cleared while a decode sleeps uncounted
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False
        self.arrivals = arrivals

    # ------------------------------------------------------------ event-loop side

    def _ensure_started(self) -> None:
        if self._stopped:
            raise RuntimeError("the model runner is shut down")
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            self._settled = asyncio.Event()
            self._settled.set()
            self._task = self._loop.create_task(self._main(), name="arealite-sim-runner")

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def generate(self, inp: GenerateInput) -> Sequence:
        """Queue one sequence and wait for it to finish (or be aborted)."""
        self._ensure_started()
        if self.arrivals is not None:
            self.arrivals.append((inp.rid, time.time()))
        loop = asyncio.get_running_loop()
        sp = inp.sampling
        self._arrivals += 1
        draw = sp.sampling_seed if sp.sampling_seed is not None else (None if sp.greedy else self._arrivals)
        seq = SimSequence(inp=inp, future=loop.create_future(), loop=loop, stop_ids=frozenset(), draw=draw,
                          stops=frozenset(sp.stop_token_ids) | self.eos_ids)
        self._waiting.append(seq)
        if len(self._running) < self.max_batch_size:  # a full batch takes it when a row frees
            self._poke()
        try:
            return await seq.future
        except asyncio.CancelledError:
            self._abort(lambda s: s is seq, "the client disconnected")
            raise

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` between two steps (on the loop, once the decode under way has counted
        the steps made so far) and return its result."""
        self._ensure_started()
        if self._settled is not None and not self._settled.is_set():
            self._poke()
            await self._settled.wait()
        try:
            return fn()
        finally:
            self.prompt_cache.clear()  # as ModelRunner: weights change only through commands
            self._poke()

    async def hold(self, seconds: float) -> None:
        """Stop generating for ``seconds`` of simulated time (a weight load in the scheduler)."""
        self._ensure_started()
        self._holds += 1
        self._poke()
        try:
            await asyncio.sleep(seconds * self.spec.time_scale)
            self.stats["sim_transfer_s"] += seconds
        finally:
            self._holds -= 1
            self._poke()

    def shutdown(self) -> None:
        """Stop (from any thread); unfinished requests are aborted."""
        loop = self._loop
        done = threading.Event()

        def stop() -> None:
            self._stopped = True
            if self._settled is not None:  # no call waits on a decode that will not count
                self._settled.set()
            self._abort(lambda s: True, "server shutting down")
            if self._task is not None:
                self._task.cancel()
            done.set()

        if loop is None or loop.is_closed() or not loop.is_running() or _on_loop(loop):
            stop()
            return
        try:
            loop.call_soon_threadsafe(stop)
        except RuntimeError:  # the loop closed meanwhile
            return
        done.wait(10)

    # Commands (through `call`).

    def set_paused(self, paused: bool, mode: str = "abort") -> int:
        """Pause admission (and abort or freeze running sequences); returns how many were running."""
        n = self.pause.set(self, paused, mode)
        self._poke()  # a continue restarts the scheduler
        return n

    def abort(self, rid_prefix: str | None, message: str) -> int:
        return self._abort(lambda s: rid_prefix is None or s.inp.rid.startswith(rid_prefix), message)

    def retract_running(self) -> int:
        """Put the running sequences back at the head of the queue; their KV is recomputed
        (prompt + tokens made) when they are admitted again."""
        runs, self._running = self._running, []
        for r in reversed(runs):
            assert isinstance(r.seq, SimSequence)
            self._kv_reserved -= len(r.seq.inp.input_ids) + r.target
            r.seq.resume = r
            self._waiting.appendleft(r.seq)
        self.stats["retracted"] = self.stats.get("retracted", 0) + len(runs)
        return len(runs)

    @property
    def weight_version(self) -> str:
        """The version the (simulated) weights carry."""
        return self._weight_version

    @weight_version.setter
    def weight_version(self, version: str) -> None:
        if version != self._weight_version:
            made = [(r.seq, r.made) for r in self._running]
            made += [(s, s.resume.made) for s in self._waiting if isinstance(s, SimSequence) and s.resume]
            record_version_change(made, self._weight_version)
        self._weight_version = version

    @property
    def n_running(self) -> int:
        return len(self._running)

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    # ------------------------------------------------------------ the scheduler

    def _frozen(self) -> bool:
        return self._holds > 0 or self.pause.freezes_running

    def _admissible(self) -> bool:
        return (bool(self._waiting) and self.pause.admits and self._holds == 0
                and len(self._running) < self.max_batch_size)

    async def _main(self) -> None:
        debt = 0.0  # simulated time of a step that was cut short, carried into the next
        while not self._stopped:
            try:
                admitted = self._admit() if self._admissible() else []
                if admitted:
                    await self._prefill(admitted)
                    continue
                if not self._running or self._frozen():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                debt = await self._decode(debt)
            except Exception as e:  # a bug here fails the batch, not the server
                logger.exception("simulated step failed; failing %d running requests", len(self._running))
                failed, self._running, self._kv_reserved = self._running, [], 0
                for r in failed:
                    if not r.seq.future.done():
                        r.seq.future.set_exception(RuntimeError(f"generation failed: {e}"))

    def _admit(self) -> list[_Running]:
        """Waiting sequences that fit: a free row and KV room for prompt + answer."""
        out: list[_Running] = []
        while self._waiting and len(self._running) + len(out) < self.max_batch_size:
            seq = self._waiting[0]
            run = seq.resume or self._plan(seq)
            need = len(seq.inp.input_ids) + run.target
            if self._kv_reserved + need > self.kv_capacity and (self._running or out):
                break  # wait for room (a lone request too big for the cache still runs)
            self._waiting.popleft()
            self._kv_reserved += need
            out.append(run)
        return out

    def _plan(self, seq: SimSequence) -> _Running:
        """How long the answer of ``seq`` will be (drawn once, deterministically)."""
        sp = seq.inp.sampling
        if self.eos is None or sp.ignore_eos:  # nothing ends it but its length
            return _Running(seq, sp.max_new_tokens, False)
        drawn = self.spec.draw_length(self._rng(seq, "length"))
        return _Running(seq, min(drawn, sp.max_new_tokens), drawn <= sp.max_new_tokens)

    def _rng(self, seq: SimSequence, what: str) -> np.random.Generator:
        key = _key(self.seed, what, seq.draw, seq.inp.input_ids)
        return np.random.default_rng(np.frombuffer(key, dtype=np.uint32))

    async def _prefill(self, admitted: list[_Running]) -> None:
        """One prefill for the admitted sequences (their first token); 0-token requests end at once."""
        new_tokens = 0
        for run in admitted:
            ids = run.seq.inp.input_ids
            if run.made:  # retracted: prompt and answer so far computed again
                run.seq.resume = None
                new_tokens += len(ids) + run.made
                self.stats["reprefill_tokens"] = self.stats.get("reprefill_tokens", 0) + len(ids) + run.made
                continue
            if self.prompt_cache.seen(_key(ids)):
                run.seq.cached_tokens = len(ids) - 1
            new_tokens += len(ids) - run.seq.cached_tokens
        t = self.spec.prefill_s(new_tokens)
        self.stats["prefills"] += 1
        self.stats["sim_busy_s"] += t
        # In the batch already (made 0), so that an abort during the prefill returns them.
        self._running.extend(admitted)
        self.stats["max_running"] = max(self.stats["max_running"], len(self._running))
        await asyncio.sleep(t * self.spec.time_scale)
        for run in admitted:
            if run.target > run.made and not run.seq.future.done():
                run.made += 1
                self.stats["generated_tokens"] += 1
        self._retire()

    async def _decode(self, debt: float) -> float:
        """Decode until the first sequence finishes or something wakes the runner; the
        simulated time of a step cut short is returned (it is paid by the next call)."""
        batch = len(self._running)
        kv = sum(len(r.seq.inp.input_ids) + r.made for r in self._running)
        self.stats["kv_tokens"] = kv
        n_max = min(r.left for r in self._running)
        full = max(0.0, self.spec.steps_s(n_max, batch, kv) - debt)
        self._wake.clear()
        self._settled.clear()
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(self._wake.wait(), full * self.spec.time_scale)
            elapsed = debt + (time.perf_counter() - t0) / self.spec.time_scale
            n = min(n_max, self.spec.steps_within(elapsed, batch, kv))
            debt = elapsed - self.spec.steps_s(n, batch, kv)
        except asyncio.TimeoutError:
            n, debt = n_max, 0.0
        self.stats["sim_busy_s"] += self.spec.steps_s(n, batch, kv)
        self.stats["steps"] += n
        self.stats["generated_tokens"] += n * len(self._running)  # less any a command took out meanwhile
        for r in self._running:
            r.made += n
        self._settled.set()
        self._retire()
        return debt

    def _retire(self) -> None:
        """Return the sequences that made all their tokens."""
        done = [r for r in self._running if r.left <= 0]
        if not done:
            return
        self._running = [r for r in self._running if r.left > 0]
        for r in done:
            if r.stops:
                self._finish(r, r.target, {"type": "stop", "matched": self.eos})
            else:
                self._finish(r, r.target, {"type": "length", "length": r.seq.inp.sampling.max_new_tokens})

    # ------------------------------------------------------------ results

    def _finish(self, run: _Running, n: int, reason: dict) -> None:
        seq = run.seq
        assert isinstance(seq, SimSequence)
        self._kv_reserved -= len(seq.inp.input_ids) + run.target
        if seq.future.done():
            return
        self._fill(seq, n, run.stops and n == run.target)
        seq.finish_reason = reason
        seq.weight_version = self.weight_version
        seq.end_time = time.perf_counter()
        seq.future.set_result(seq)

    def _fill(self, seq: SimSequence, n: int, ends_on_eos: bool) -> None:
        """``n`` deterministic tokens (the last an EOS when the answer stops) and their log-probs."""
        inp = seq.inp
        rng = self._rng(seq, "tokens")
        ids = rng.integers(0, self.vocab_size, n)
        if seq.stops:  # no stop token before the end: the real server would have stopped there
            ids[np.isin(ids, list(seq.stops))] = next(t for t in range(self.vocab_size) if t not in seq.stops)
        if ends_on_eos and n:
            ids[-1] = self.eos
        logprobs = -rng.exponential(0.7, n)
        seq.output_ids = ids.tolist()
        seq.output_logprobs = logprobs.tolist()
        if inp.top_logprobs_num:
            seq.output_top_logprobs = [
                [[lp, t, None]] + [[lp - 1.0 - j, (t + j + 1) % self.vocab_size, None]
                                   for j in range(inp.top_logprobs_num - 1)]
                for lp, t in zip(seq.output_logprobs, seq.output_ids)]
        if inp.logprob_start_len >= 0:
            m = max(0, len(inp.input_ids) - inp.logprob_start_len - 1)
            seq.input_logprobs = [None] + (-rng.exponential(2.0, m)).tolist()

    def _abort(self, pred: Callable[[Sequence], bool], message: str) -> int:
        reason = {"type": "abort", "message": message}
        n = 0
        keep: deque[Sequence] = deque()
        for s in self._waiting:
            assert isinstance(s, SimSequence)
            if pred(s):
                if not s.future.done():
                    self._fill(s, s.resume.made if s.resume else 0, False)
                    s.finish_reason, s.weight_version, s.end_time = dict(reason), self.weight_version, time.perf_counter()
                    s.future.set_result(s)
                n += 1
            else:
                keep.append(s)
        self._waiting = keep
        hit = [r for r in self._running if pred(r.seq)]
        if hit:
            self._running = [r for r in self._running if not pred(r.seq)]
            for r in hit:
                self._finish(r, r.made, dict(reason))
        self._poke()
        return n + len(hit)


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def sim_runner_class(spec: SimSpec, arrivals: list[tuple[str, float]] | None = None) -> Callable[..., SimRunner]:
    """What `EmbeddedServer` takes as ``runner_class`` to run ``spec``'s cost model."""

    def build(model: object = None, **kwargs: object) -> SimRunner:
        return SimRunner(model, spec=spec, arrivals=arrivals, **kwargs)
    return build
