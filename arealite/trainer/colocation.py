"""`launch.placement: colocated`: trainer and servers take turns on the same GPUs (`TimeSharing`).

One step, as the trainer runs it:

    servers generate the batch          trainer state waits in host memory
    trainer_turn()                      rank 0: pause and release the servers' weights and KV
                                        cache; every rank loads its state back (onload_s)
    train                               the GPUs are the trainer's
    publish(publisher, version)         rank 0: resume the servers' weights; the publisher
                                        pushes, and once the weights are read every rank
                                        offloads (offload_s), then rank 0 resumes the KV
                                        cache; the probe then checks the woken servers

The order is the one that keeps the peak lowest: the servers' weights come back while the
trainer still holds its own (the push needs both), the KV cache only after the trainer's
state has left. Synchronous by nature (`rollout.max_head_offpolicyness` 0, checked by the
config): nothing is generated while the servers sleep.

Faults. A trainer that dies while the servers sleep leaves them released, not broken: the
next trainer to start (`wake_at_start`, before its first publish) resumes them. That is the
one party that always comes back, for servers the launcher started and for servers started
elsewhere alike; a launcher-side resume would not cover the latter. What is asleep is written
to the run directory (``servers_asleep.json``) as soon as a release answers and cleared as
soon as a resume does: SGLang cannot be asked, and resuming a tag it has not released kills
its scheduler (docs/sglang.md), so the next trainer resumes exactly what the file names.
Every release and resume has a deadline that names it; a resume that fails is retried
(`launch.time_sharing.resume_attempts`) and then reported naming the servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Coroutine, Iterator, Sequence
from pathlib import Path

import torch

from arealite.api.contracts import Runner
from arealite.config.launch import TimeSharingConfig
from arealite.train_engine.offload import EngineOffload
from arealite.utils.dist import barrier
from arealite.weight_sync.publisher import WeightPublisher

logger = logging.getLogger("arealite.trainer")

__all__ = ["MEMORY_TAGS", "ServersAsleepError", "TimeSharing"]

#: SGLang's tags of what a server releases: its weights and its KV cache.
WEIGHTS, KV_CACHE = "weights", "kv_cache"
MEMORY_TAGS = (WEIGHTS, KV_CACHE)


class ServersAsleepError(RuntimeError):
    """The servers could not be woken (or put to sleep); the message names them and the call."""


class TimeSharing:
    """The turns of one trainer rank and the servers (rank 0 alone talks to the servers).

    ``engines``: the train engines whose state leaves the device (actor, reference, critic);
    ``admin``/``run``: the servers' administration and the runner of its coroutines (the
    rollout side's); ``rank``: this trainer rank; ``asleep_file``: where rank 0 keeps the
    tags the servers hold released (None: nowhere, nothing to wake at start-up).
    """

    # what it switches: the servers (through rank 0's admin) and this rank's engines
    config: TimeSharingConfig
    admin: object
    run: Runner
    rank: int
    offloads: list[EngineOffload]
    # what the servers hold released now (rank 0), and the file that outlives this trainer
    asleep: list[str]
    asleep_file: Path | None
    # the timings of the step under way, handed to the stats by `take_timings`
    timings: dict[str, float]

    def __init__(self, config: TimeSharingConfig, engines: Sequence[object], admin: object, run: Runner,
                 rank: int, asleep_file: Path | None = None):
        for name in ("release_memory_occupation", "resume_memory_occupation"):
            if not callable(getattr(admin, name, None)):
                raise TypeError(f"launch.placement=colocated needs servers that release their memory, but the "
                                f"admin {type(admin).__name__} has no {name}")
        self.config, self.admin, self.run, self.rank = config, admin, run, rank
        self.offloads = [EngineOffload(e) for e in engines] if config.offload else []
        self.asleep, self.asleep_file = [], asleep_file
        self.timings = {}

    # ------------------------------------------------------------------ the turns

    def wake_at_start(self) -> None:
        """Rank 0, before the first publish: resume what a dead trainer left released (the file says
        what); the publish then rewrites the weights, whose contents a release does not keep."""
        if self.rank != 0 or self.asleep_file is None or not self.asleep_file.exists():
            return
        self.asleep = [t for t in json.loads(self.asleep_file.read_text()).get("tags", []) if t in MEMORY_TAGS]
        if self.asleep:
            logger.warning("the servers' %s were left released (%s): resuming them", self.asleep, self.asleep_file)
            self._resume(list(self.asleep), why="at start-up (the previous trainer died with them asleep)")

    def trainer_turn(self) -> dict[str, float]:
        """After generation: rank 0 pauses and releases the servers, every rank loads its state.
        Returns the step's ``release_s`` and ``onload_s``."""
        t0 = time.perf_counter()
        gpu = _gpu_free_gib()
        barrier()  # every rank holds its batch: no episode still waits on a server about to sleep
        if self.rank == 0:
            # abort whatever pause_mode says: SGLang releases memory only with nothing in its batch
            self._call(self.admin.pause_generation("abort"), "pause_generation(mode=abort)")
            self._call(self.admin.release_memory_occupation(list(MEMORY_TAGS)),
                       f"release_memory_occupation(tags={list(MEMORY_TAGS)})")
            self._record_asleep(list(MEMORY_TAGS))
        barrier()  # no rank loads onto a GPU its server still holds
        self.timings = {"release_s": time.perf_counter() - t0}
        if gpu is not None:  # what the servers' release gave back to the card
            self.timings.update(gpu_free_gib_before_release=gpu, gpu_free_gib_after_release=_gpu_free_gib())
        self.timings["onload_s"] = sum(o.onload() for o in self.offloads)
        return dict(self.timings)

    def publish(self, publisher: WeightPublisher, version: int) -> dict[str, float]:
        """Wake the servers' weights, push ``version`` through ``publisher`` (which calls
        `after_read` once the weights are read), return the push's figures."""
        if self.rank == 0:
            t0 = time.perf_counter()
            self._resume((WEIGHTS,), why="before the push")
            self.timings["wake_weights_s"] = time.perf_counter() - t0
        return publisher.publish(version)

    def after_read(self) -> None:
        """Every rank, the trainer's weights read: offload them, then rank 0 wakes the KV cache."""
        before = _gpu_allocated_gib()
        self.timings["offload_s"] = sum(o.offload() for o in self.offloads)
        if before is not None:
            self.timings.update(trainer_allocated_gib_before_offload=before,
                                trainer_allocated_gib_after_offload=_gpu_allocated_gib())
        barrier()  # every rank's state has left before a server takes its KV cache back
        if self.rank == 0:
            t0 = time.perf_counter()
            self._resume((KV_CACHE,), why="after the push")
            self.timings["wake_kv_cache_s"] = time.perf_counter() - t0

    def take_timings(self) -> dict[str, float]:
        """The step's switch timings (release, onload, offload, wakes), once."""
        out, self.timings = self.timings, {}
        return out

    def onload_for_good(self) -> float:
        """Bring this rank's state back to stay (the end of the run); returns the seconds taken."""
        return sum(o.onload() for o in self.offloads)

    @contextlib.contextmanager
    def state_on_device(self) -> Iterator[None]:
        """The trainer's state on its device for a while (a checkpoint, the final export), parked after."""
        parked = any(o.offloaded for o in self.offloads)
        for o in self.offloads:
            o.onload()
        try:
            yield
        finally:
            if parked:
                for o in self.offloads:
                    o.offload()

    # ------------------------------------------------------------------ server calls

    def _resume(self, tags: Sequence[str], why: str) -> None:
        """Resume those of ``tags`` the servers hold released (SGLang dies resuming any other)."""
        tags = [t for t in tags if t in self.asleep]
        if not tags:
            return
        what = f"resume_memory_occupation(tags={tags}) {why}"
        attempts = self.config.resume_attempts
        for attempt in range(1, attempts + 1):
            try:
                self._call(self.admin.resume_memory_occupation(list(tags)), what)
                self._record_asleep([t for t in self.asleep if t not in tags])
                return
            except (ServersAsleepError, OSError, RuntimeError) as e:
                if attempt == attempts:
                    raise ServersAsleepError(
                        f"{what} failed {attempts} time(s), last: {e}. The servers stay asleep: restart "
                        "the run (its start-up resumes them) or the servers") from e
                logger.warning("%s failed (attempt %d of %d): %s; retrying", what, attempt, attempts, e)
                time.sleep(min(2.0 ** (attempt - 1), 10.0))

    def _record_asleep(self, tags: list[str]) -> None:
        """Rank 0: the servers hold ``tags`` released now; the file says so (atomically) or is gone."""
        self.asleep = tags
        if self.asleep_file is None:
            return
        if not tags:
            self.asleep_file.unlink(missing_ok=True)
            return
        tmp = self.asleep_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"tags": tags, "servers": self._servers()}))
        os.replace(tmp, self.asleep_file)

    def _call(self, coro: Coroutine, what: str) -> object:
        timeout = self.config.memory_timeout_s

        async def bounded() -> object:
            try:
                return await asyncio.wait_for(coro, timeout)
            except asyncio.TimeoutError:
                raise ServersAsleepError(
                    f"{what} on the servers {self._servers()} did not answer within {timeout:g}s "
                    "(launch.time_sharing.memory_timeout_s)") from None

        return self.run(bounded())

    def _servers(self) -> list[str]:
        return list(getattr(self.admin, "healthy_servers", []) or [])


def _gpu_free_gib() -> float | None:
    """Free memory on this rank's GPU, every process counted (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.mem_get_info()[0] / 2**30


def _gpu_allocated_gib() -> float | None:
    """What this process's tensors hold on its GPU (None without CUDA)."""
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None
