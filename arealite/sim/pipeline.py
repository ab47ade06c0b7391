"""The asynchronous RL pipeline in virtual time, with nothing but its rules: what the cost model
and the staleness bound allow when orchestration costs nothing.

`benchmarks/scale_overlap.py` runs the real trainer, controller and client against simulated
servers in real time; its bound, ``max(busy generation, training)`` per step, assumes servers that
never idle. The staleness bound does not let them: at ``eta`` only ``(eta + v + 1) · B`` groups
may have started by version ``v``, a group holds its place until its longest answer ends, and
finished groups wait for the trainer's next take. This module plays the same run as events in
virtual time (no sleeping, no HTTP, no Python on the critical path), so its step time is the
fastest any orchestration can reach under those rules; the benchmark reports its own step
against it.

What is modelled, as `arealite.sim.runner.SimRunner` and the controller do it:

- each server batches continuously under `SimSpec`'s cost model: newly arrived answers are
  prefilled together (decoding stops meanwhile), then the batch decodes until its first answer
  ends or something arrives; a step cut short carries its simulated time into the next;
- a group's answers go to one server (the client's affinity), groups round-robin over servers;
- admission by `StalenessManager` (``max_concurrent_rollouts`` and the staleness limit), at once;
- the trainer takes the ``B`` stalest ready groups as soon as it is free and they are there,
  waiting, if ``hold_overdue``, for running groups the staleness bound puts in this batch (the
  controller's rule);
  it trains for ``train_s``, then the servers freeze for ``push_s`` (``pause_mode``: ``in_place``
  decodes on after it; ``retract`` and ``abort`` prefill the answers in flight again) and the
  version moves on.

All times are real seconds: the servers' simulated seconds times ``spec.time_scale``.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from arealite.rollout.staleness import StalenessManager, overdue_running

from .cost_model import SimSpec

__all__ = ["PipelineResult", "PipelineSetup", "busy_generation_s", "capped_mean", "median_for_mean",
           "simulate_pipeline"]


@dataclass(frozen=True)
class PipelineSetup:
    spec: SimSpec
    n_servers: int
    rows_per_server: int
    """Answers one server decodes at once (``server.max_batch_size``)."""
    batch_groups: int
    group_size: int
    eta: int
    max_concurrent: int
    max_new_tokens: int
    prompt_tokens: int
    train_s: float
    """The trainer's real seconds per step before the push, beside ``train_s_per_token``."""
    push_s: float
    """Real seconds the servers are frozen for a push."""
    train_s_per_token: float = 0.0
    """Real seconds per token (prompt and answer) of the batch: training time follows its
    tokens, as the simulated train engine's does, so batches of long groups take longer."""
    hold_overdue: bool = True
    seed: int = 0
    pause_mode: str = "in_place"
    """``in_place``: the running answers freeze and decode on; ``retract`` and ``abort``: they are
    prefilled again over prompt + tokens made after the push (abort's resubmission by the client
    costs nothing here, so it plays as retract)."""

    def __post_init__(self) -> None:
        if self.pause_mode not in ("in_place", "retract", "abort"):
            raise ValueError(f"pause_mode {self.pause_mode!r}: expected in_place, retract or abort")


@dataclass
class PipelineResult:
    step_ends: list[float]
    rows_busy: float
    """Mean running answers over every server's rows, from the first measured step on."""
    group_latency_s: float
    """Mean admission-to-last-answer time of a group."""
    ready_at_take: float
    """Mean groups ready when the trainer took a batch."""
    trainer_wait_s: float
    """Mean time per step the trainer waited for its batch."""
    staleness_max: int
    """The most versions between a taken group's admission and the version that trains on it."""

    def step_s(self, skip: int) -> float:
        """Seconds per step over the steps after the first ``skip``, as the benchmark counts them."""
        start = self.step_ends[skip - 1] if skip else 0.0
        return (self.step_ends[-1] - start) / (len(self.step_ends) - skip)


@functools.lru_cache(maxsize=8)
def _lognormal_grid(sigma: float, n: int = 2000) -> tuple[float, ...]:
    """``n`` equally likely quantiles of a lognormal of median 1."""
    normal = statistics.NormalDist()
    return tuple(math.exp(sigma * normal.inv_cdf((i + 0.5) / n)) for i in range(n))


def capped_mean(median: float, sigma: float, cap: int) -> float:
    """The mean of lognormal answers (``median``, ``sigma``) cut at ``cap`` tokens."""
    grid = _lognormal_grid(sigma)
    return sum(min(median * g, cap) for g in grid) / len(grid)


def median_for_mean(mean: float, sigma: float, cap: int) -> float:
    """The lognormal median (``SimSpec.length_median``) whose answers, cut at ``cap`` tokens,
    average ``mean`` tokens: to play a run whose measured answers came out shorter or longer
    than the distribution's own mean (a few hundred answers vary by a few percent)."""
    if not 0 < mean < cap:
        raise ValueError(f"mean answer length {mean} must be in (0, cap={cap})")
    lo, hi = 1e-3, float(cap)
    while capped_mean(hi, sigma, cap) < mean:
        hi *= 2
    for _ in range(60):  # bisection on the median: the capped mean grows with it
        mid = math.sqrt(lo * hi)
        if capped_mean(mid, sigma, cap) < mean:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def busy_generation_s(spec: SimSpec, n_servers: int, rows: int, answers: int, answer_len: float,
                      seq_len: float) -> float:
    """Real seconds ``n_servers`` servers take for ``answers`` answers of ``answer_len`` tokens
    (``seq_len`` with the prompt) when never idle: every server decoding ``rows`` rows at once,
    half of each answer in the cache on average."""
    kv = rows * (seq_len - answer_len / 2)
    tokens_per_s = n_servers * rows / spec.step_s(rows, int(kv))
    return answers * answer_len / tokens_per_s * spec.time_scale


class _Clock:
    """Events in virtual time: callbacks run in time order (ties in scheduling order)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    def run_until(self, done: Callable[[], bool]) -> None:
        while self._heap and not done():
            self.now, _, fn = heapq.heappop(self._heap)
            fn()
        if not done():
            raise RuntimeError("the simulated pipeline stalled: no event left before the last step")


@dataclass(eq=False)
class _Answer:
    group: _Group
    target: int
    made: int = 0


@dataclass(eq=False)  # identity: two groups alike are still two
class _Group:
    version: int
    admitted_at: float
    left: int
    tokens: int = 0
    """Prompt and answer tokens of all its answers."""
    first_of_prompt: bool = True


class _Server:
    """One server's continuous batching, event by event (SimRunner's loop without the sleeping).

    Every running answer advances by the same steps, so the server counts the steps it has
    decoded (``_steps``) and keeps each answer's end as the count at which it is done, in a heap:
    the next end, the KV held and the finished answers cost O(log rows), not O(rows).
    """

    def __init__(self, spec: SimSpec, rows: int, prompt_tokens: int, clock: _Clock,
                 on_done: Callable[[_Answer], None]):
        self.spec, self.rows, self.prompt_tokens = spec, rows, prompt_tokens
        self.clock, self.on_done = clock, on_done
        self.waiting: deque[_Answer] = deque()
        self._ends: list[tuple[int, int, _Answer]] = []  # (step count at its end, arrival, answer)
        self._arrivals = itertools.count()
        self._steps = 0
        self._targets_less_ends = 0  # sum over running answers of target - end: made = that + _steps
        self.phase = "idle"  # idle | prefill | decode | frozen
        self.frozen = False
        self._retract_at_freeze = False
        self._seg = 0  # the pending step's number: a later one cancels it
        self._debt = 0.0
        self._decode: tuple[float, int, int, int] = (0.0, 0, 0, 0)  # start, n_max, batch, kv
        self._area, self._last = 0.0, 0.0  # integral of len(running) over time

    def _account(self) -> None:
        t = self.clock.now
        self._area += len(self._ends) * (t - self._last)
        self._last = t

    def busy_rows_area(self) -> float:
        self._account()
        return self._area

    def submit(self, answer: _Answer) -> None:
        self.waiting.append(answer)
        if self.phase == "idle":
            self._next()
        elif self.phase == "decode":
            self._cut()
            self._next()

    def freeze(self, retract: bool = False) -> None:
        """Hold generation for a push; ``retract``: the running answers go back to the head of
        the queue, to be prefilled again over prompt + tokens made (a prefill under way ends
        first, as the decode step under way does)."""
        self.frozen, self._retract_at_freeze = True, retract
        if self.phase == "decode":
            self._cut()
            self._park()
        elif self.phase == "idle":
            self._park()

    def _park(self) -> None:
        self.phase = "frozen"
        if self._retract_at_freeze:
            self._retract_at_freeze = False
            self._account()
            made = self._steps
            back = sorted(self._ends, key=lambda e: e[1])  # the running answers in arrival order
            for end, _, a in back:
                a.made = a.target - (end - made)
            self.waiting.extendleft(a for _, _, a in reversed(back))
            self._ends, self._targets_less_ends = [], 0

    def thaw(self) -> None:
        self.frozen = False
        if self.phase == "frozen":
            self.phase = "idle"
            self._next()

    def _next(self) -> None:
        """Prefill what waits and fits, else decode, else idle (or stay frozen)."""
        self._seg += 1
        if self.frozen:
            self._park()
            return
        admitted = []
        while self.waiting and len(self._ends) + len(admitted) < self.rows:
            admitted.append(self.waiting.popleft())
        seg, scale = self._seg, self.spec.time_scale
        if admitted:
            new_tokens = 0
            for a in admitted:
                if a.made:  # retracted: prompt and answer so far computed again
                    new_tokens += self.prompt_tokens + a.made
                else:
                    new_tokens += self.prompt_tokens if a.group.first_of_prompt else 1
                a.group.first_of_prompt = False
            self._account()
            for a in admitted:  # the prefill makes each answer's first token
                a.made = min(a.target, a.made + 1)
                end = self._steps + a.target - a.made
                self._targets_less_ends += a.target - end
                heapq.heappush(self._ends, (end, next(self._arrivals), a))
            self.phase = "prefill"
            self.clock.at(self.clock.now + self.spec.prefill_s(new_tokens) * scale,
                          self._prefilled)
        elif self._ends:
            batch = len(self._ends)
            kv = batch * (self.prompt_tokens + self._steps) + self._targets_less_ends
            n_max = self._ends[0][0] - self._steps
            full = max(0.0, self.spec.steps_s(n_max, batch, kv) - self._debt)
            self._decode = (self.clock.now, n_max, batch, kv)
            self.phase = "decode"
            self.clock.at(self.clock.now + full * scale, lambda: self._decoded(seg))
        else:
            self.phase = "idle"

    def _prefilled(self) -> None:
        self._retire()
        self._next()

    def _decoded(self, seg: int) -> None:
        if seg != self._seg:
            return  # cut short by an arrival or a freeze
        self._advance(self._decode[1])
        self._debt = 0.0
        self._retire()
        self._next()

    def _cut(self) -> None:
        """An arrival or a freeze during decoding: credit the whole steps made so far."""
        start, n_max, batch, kv = self._decode
        elapsed = self._debt + (self.clock.now - start) / self.spec.time_scale
        n = min(n_max, self.spec.steps_within(elapsed, batch, kv))
        self._debt = elapsed - self.spec.steps_s(n, batch, kv)
        self._advance(n)
        self._retire()
        self._seg += 1

    def _advance(self, n: int) -> None:
        self._steps += n

    def _retire(self) -> None:
        ends, done = self._ends, []
        if ends and ends[0][0] <= self._steps:
            self._account()
        while ends and ends[0][0] <= self._steps:
            end, _, a = heapq.heappop(ends)
            self._targets_less_ends -= a.target - end
            a.made = a.target
            done.append(a)
        for a in done:
            self.on_done(a)


@dataclass
class _Trainer:
    busy: bool = False
    waiting_since: float = 0.0
    waits: list[float] = field(default_factory=list)
    ready_at_take: list[int] = field(default_factory=list)
    staleness_max: int = 0
    step_ends: list[float] = field(default_factory=list)


class _Pipeline:
    """Admission, ready groups and the trainer around the servers."""

    def __init__(self, setup: PipelineSetup):
        self.s = setup
        self.clock = _Clock()
        self.rng = np.random.default_rng(setup.seed)
        self.manager = StalenessManager(setup.max_concurrent, setup.batch_groups, setup.eta)
        self.servers = [_Server(setup.spec, setup.rows_per_server, setup.prompt_tokens, self.clock, self._answer_done)
                        for _ in range(setup.n_servers)]
        self.rr = 0
        self.running: list[_Group] = []
        self.ready: list[_Group] = []
        self.latencies: list[float] = []
        self.trainer = _Trainer()

    def admit(self) -> None:
        s = self.s
        while self.manager.capacity() > 0:
            self.manager.on_submit()
            group = _Group(self.manager.version, self.clock.now, s.group_size)
            self.running.append(group)
            server = self.servers[self.rr % len(self.servers)]
            self.rr += 1
            for _ in range(s.group_size):
                target = max(1, min(s.spec.draw_length(self.rng), s.max_new_tokens))
                group.tokens += s.prompt_tokens + target
                server.submit(_Answer(group, target))

    def _answer_done(self, answer: _Answer) -> None:
        group = answer.group
        group.left -= 1
        if group.left:
            return
        self.running.remove(group)
        self.manager.on_accept()
        self.ready.append(group)
        self.latencies.append(self.clock.now - group.admitted_at)
        # Not in this call: the server that finished it is still retiring its batch.
        self.clock.at(self.clock.now, self._after_finish)

    def _after_finish(self) -> None:
        self.admit()
        self.take()

    def take(self) -> None:
        s, tr, version = self.s, self.trainer, self.manager.version
        if tr.busy or len(self.ready) < s.batch_groups:
            return
        if s.hold_overdue and overdue_running(
                version, s.eta, s.batch_groups, len(self.running),
                lambda v: sum(g.version <= v for g in self.running), lambda v: sum(g.version <= v for g in self.ready)):
            return
        self.ready.sort(key=lambda g: g.version)  # stable: the stalest first, then in finishing order
        tr.ready_at_take.append(len(self.ready))
        tr.staleness_max = max(tr.staleness_max, version - self.ready[0].version)
        tokens = sum(g.tokens for g in self.ready[:s.batch_groups])
        del self.ready[:s.batch_groups]
        tr.waits.append(self.clock.now - tr.waiting_since)
        tr.busy = True
        self.clock.at(self.clock.now + s.train_s + s.train_s_per_token * tokens, self._trained)

    def _trained(self) -> None:
        for server in self.servers:
            server.freeze(retract=self.s.pause_mode != "in_place")
        self.clock.at(self.clock.now + self.s.push_s, self._pushed)

    def _pushed(self) -> None:
        self.manager.set_version(self.manager.version + 1)
        for server in self.servers:
            server.thaw()
        tr = self.trainer
        tr.busy, tr.waiting_since = False, self.clock.now
        tr.step_ends.append(self.clock.now)
        self.admit()
        self.take()


def simulate_pipeline(setup: PipelineSetup, steps: int, skip: int = 2) -> PipelineResult:
    """Play ``steps`` training steps; the figures are over the steps after the first ``skip``."""
    if not 0 <= skip < steps:
        raise ValueError(f"skip={skip} must be in [0, steps={steps})")
    p = _Pipeline(setup)
    p.admit()
    mark: dict[str, float] = {}

    def measured_from_here() -> bool:
        if len(p.trainer.step_ends) >= skip and "t" not in mark:
            mark["t"] = p.clock.now
            mark["area"] = sum(sv.busy_rows_area() for sv in p.servers)
            mark["groups"] = len(p.latencies)
        return len(p.trainer.step_ends) >= steps

    p.clock.run_until(measured_from_here)
    span = p.clock.now - mark["t"]
    area = sum(sv.busy_rows_area() for sv in p.servers) - mark["area"]
    rows = setup.n_servers * setup.rows_per_server
    tr = p.trainer
    return PipelineResult(
        step_ends=tr.step_ends,
        rows_busy=area / (span * rows) if span > 0 else 0.0,
        group_latency_s=statistics.fmean(p.latencies[int(mark["groups"]):] or p.latencies),
        ready_at_take=statistics.fmean(tr.ready_at_take[skip:] or tr.ready_at_take),
        trainer_wait_s=statistics.fmean(tr.waits[skip:] or tr.waits),
        staleness_max=tr.staleness_max)
