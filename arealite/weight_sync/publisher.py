"""One call publishes a new version of the weights: `WeightPublisher.publish(version)`.

Every trainer rank calls it after each training step; only rank 0 talks to the servers.
The sequence, the same for every transfer (disk, shm, distributed):

    controller.pause()                   every rank: admit no new episodes
    transfer.stage(source, version)      rank 0: what needs no pause (write the weights)
    pause_generation                     rank 0: in weight_sync.pause_mode (abort: in-flight requests
                                         come back cut; retract, in_place: they stay in the servers)
    transfer.transfer(source, version)   rank 0: load the weights on every server
    verify                               rank 0: read a sample back (`WeightVerifier`)
    after_read()                         every rank, when given: the source is read in full
    set_version(version) on every party  train engine, controller, client
    continue_generation                  rank 0: generation goes on with the new weights
    check_serving                        rank 0: the log-prob probe (it generates)
    controller.resume()                  every rank

Before all of it every rank runs ``verifier.prepare(version)`` (the trainer's side of
the probe, a forward that is a collective on a sharded engine). A probe that fails
pauses the servers again before raising.

Reading the source is a collective on a sharded engine: the other ranks read it along
with rank 0 (again each time the transfer starts over, `RETRY`), then learn from rank 0
how the update ended (`agree`) before they set the version and resume.

A server that is gone (no answer to its health route) is dropped from rotation and
the update goes on with the others.

Each phase's wall time (``pause_s``, ``transfer_s``: sending and the servers' loading,
``verify_s``, ``continue_s``, ``probe_s``) and the client's CPU on it (``<phase>_client_cpu_s``,
``total_client_cpu_s``, and ``held_client_cpu_s`` from the pause to the continue: this thread plus
the admin calls' own CPU, their thread's and the rollout loop's share in sending them, not the
rollout's work meanwhile) are returned and logged every step. Any other failure, or no server left,
raises `WeightSyncError` on every rank with the servers left paused and the controller
not resumed, so that nothing generates with weights that are not the trainer's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import TypeVar

import torch

from arealite.api.contracts import (
    Pausable,
    Runner,
    Versioned,
    WeightSource,
    WeightTransfer,
    WeightUpdateAdmin,
    require,
)
from arealite.weight_sync.base import (
    DONE,
    FAILED,
    READ,
    RETRY,
    Timer,
    agree,
    call_dropping_dead,
    drain,
    rank0_failed,
    thread_cpu_clock,
    trainer_rank,
)
from arealite.weight_sync.verify import WeightVerifier

logger = logging.getLogger("arealite.weight_sync")

T = TypeVar("T")

__all__ = ["WeightPublisher"]


async def _current_thread() -> int:
    return threading.get_ident()


class _InStep:
    """Rank 0's reads of the source, kept in step with the other ranks' reads.

    Reading a sharded engine is a collective, so every rank must read it as often as rank
    0 does. The other ranks read it once, then once more each time rank 0 says `RETRY`
    (`agree`), until it says `DONE` or `FAILED`. This wrapper says `RETRY` whenever the
    transfer starts reading anew (a server died mid-way), and `settle` makes up for what
    rank 0 did not read: the rest of an unfinished read, or the read the others are in.
    """

    def __init__(self, inner: WeightSource, bucket_bytes: int):
        self.inner, self.bucket_bytes = inner, bucket_bytes
        self.reads = 0
        self.broken = False  # the source itself raised: no use reading it further
        self._open: Iterator | None = None

    def named_weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        if bucket_bytes != self.bucket_bytes:
            raise ValueError(f"the transfer reads buckets of {bucket_bytes} bytes but announced "
                             f"bucket_bytes={self.bucket_bytes}: the other ranks would read other buckets")
        if self.reads:
            self._finish_open()
            agree(RETRY)
        self.reads += 1
        it = iter(self.inner.named_weight_buckets(bucket_bytes))
        self._open = it
        return self._watch(it)

    def _watch(self, it: Iterator) -> Iterator[list[tuple[str, torch.Tensor]]]:
        while True:
            try:
                bucket = next(it)
            except StopIteration:
                if self._open is it:
                    self._open = None
                return
            except BaseException:
                self.broken = True
                self._open = None
                raise
            yield bucket

    def _finish_open(self) -> None:
        if self._open is not None:
            for _ in self._watch(self._open):
                pass

    def settle(self) -> None:
        """Read what the other ranks read and rank 0 did not (raises if the source fails)."""
        if self.reads == 0:
            for _ in self.named_weight_buckets(self.bucket_bytes):
                pass
        else:
            self._finish_open()

    def settle_after_failure(self) -> bool:
        """`settle` after rank 0 failed; False when the ranks cannot be brought in step."""
        if self.broken:
            return False
        try:
            self.settle()
        except Exception:  # noqa: BLE001 - the original failure is the one to report
            logger.exception("weight update: reading the source along with the other trainer ranks failed")
            return False
        return True


class WeightPublisher:
    """Publishes new weights to the inference servers: pause, transfer, verify, set the
    version on every party, continue (see the module's docstring).

    ``transfer`` moves the weights (disk, shm, distributed; used on rank 0 only);
    ``source`` is what it reads (the train engine; every rank reads it); ``admin`` the
    servers' administration (rank 0 uses it); ``run`` runs an admin coroutine on the
    client's event loop (``RolloutController.run``).
    ``parties`` get ``set_version`` once the servers hold the version (the train engine,
    the client); ``controller`` is paused for the update and resumed after it (and is a
    party too). ``verifier`` checks the servers (by default nothing is read back: give a
    `ReadbackVerifier`; `make_publisher` does). ``after_read``, when given, runs on every rank
    once the source has been read in full, before the verification (the time-shared placement
    offloads the trainer there and wakes the servers' KV cache, `trainer.colocation`).
    """

    def __init__(self, transfer: WeightTransfer, source: WeightSource, admin: WeightUpdateAdmin,
                 run: Runner, parties: Sequence[Versioned] = (), *, controller: Pausable | None = None,
                 verifier: WeightVerifier | None = None, after_read: Callable[[], None] | None = None):
        require(transfer, WeightTransfer, "the weight transfer")
        require(source, WeightSource, "the weight source")
        require(admin, WeightUpdateAdmin, "the servers' admin")
        if controller is not None:
            require(controller, Pausable, "the controller")
        self.transfer, self.source, self.admin, self.run = transfer, source, admin, run
        self.controller = controller
        self.parties: list[Versioned] = list(parties)
        if controller is not None and not any(p is controller for p in self.parties):
            self.parties.append(controller)  # type: ignore[arg-type]
        for p in self.parties:
            if not callable(getattr(p, "set_version", None)):
                raise TypeError(f"party {type(p).__name__} has no set_version(version)")
        self.verifier = verifier
        self.after_read = after_read
        self._initialized = False
        self._loop_thread: int | None = None  # the client's event-loop thread (its CPU is the update's too)

    # ------------------------------------------------------------ lifecycle

    def init(self) -> None:
        """Set the transfer up (every rank calls it, once; rank 0 does the work and its
        failure stops every rank)."""
        if self._initialized:
            return
        rank, _ = trainer_rank()
        if rank != 0:
            if agree() == FAILED:
                raise rank0_failed(None)
            self._initialized = True
            return
        try:
            self.transfer.init()
        except BaseException:
            agree(FAILED)
            raise
        agree(DONE)
        self._initialized = True

    def close(self) -> None:
        """Release the transfer's resources (its group, files; rank 0); safe to call twice."""
        if trainer_rank()[0] == 0:
            self.transfer.close()

    # --------------------------------------------------------------- publish

    def publish(self, version: int) -> dict[str, float]:
        """Make every server serve ``version`` of ``source``'s weights; returns timings and
        sizes (rank 0; ``{}`` elsewhere). Every trainer rank calls it."""
        if not self._initialized:
            raise RuntimeError("WeightPublisher.publish before init(): call init() once first")
        version = int(version)
        rank, _ = trainer_rank()
        if self.controller is not None:
            self.controller.pause()
        if self.verifier is not None:
            self.verifier.prepare(version)
        if rank != 0:
            return self._follow(version)
        return self._lead(version)

    def _follow(self, version: int) -> dict[str, float]:
        """Ranks other than 0: read the source along with rank 0, then do as it says."""
        while True:
            drain(self.source, self.transfer.bucket_bytes)
            status = agree()
            if status == READ and self.after_read is not None:
                self.after_read()
                status = agree()  # how the update ended
            if status == FAILED:
                raise rank0_failed(version)
            if status == DONE:
                break
        self._set_versions(version)
        if self.controller is not None:
            self.controller.resume()
        return {}

    def _lead(self, version: int) -> dict[str, float]:
        """Rank 0: the whole sequence; the other ranks learn how it ended."""
        timer = Timer(self._client_cpu_clock())
        warm = getattr(self.admin, "warm_connections", None)
        if callable(warm):  # connect to the servers while the weights are staged, not in the pause
            warm()
        observed = self.verifier.observe(self.source, version) if self.verifier is not None else self.source
        source = _InStep(observed, self.transfer.bucket_bytes)
        try:
            out = dict(self.transfer.stage(source, version))
            timer.lap("stage_s")
            self.call(self.admin.pause_generation, version, "pause_generation")
            timer.lap("pause_s")
            out.update(self.transfer.transfer(source, version))
            source.settle()
            timer.lap("transfer_s")
            if self.after_read is not None:
                agree(READ)
                self.after_read()
                timer.lap("after_read_s")
            out.update(self.verify(version))
            timer.lap("verify_s")
            self._set_versions(version)
            self.call(self.admin.continue_generation, version, "continue_generation")
            timer.lap("continue_s")
            out.update(self._check_serving(version))
            timer.lap("probe_s")
        except BaseException:
            if source.settle_after_failure():
                agree(FAILED)
            raise
        agree(DONE)
        if self.controller is not None:
            self.controller.resume()
        out.update({k: v for k, v in timer.total().items() if k not in out})
        # The client's CPU while generation is held (pause to continue): the update's critical path.
        out["held_client_cpu_s"] = sum(out.get(f"{k}_client_cpu_s", 0.0) for k in ("pause", "transfer", "verify",
                                                                                   "continue"))
        logger.info("published version %d to %d server(s) in %.3fs", version,
                    len(self.admin.healthy_servers), out["total_s"])
        return out

    def _client_cpu_clock(self) -> Callable[[], float]:
        """CPU seconds of the client's side of an update: this thread plus the admin calls'.

        An admin with ``admin_cpu_s()`` (`SGLangAdmin`: its fan-outs run on a thread of their
        own, `arealite.inference_client.control_plane`) counts exactly that; the rollout's work
        meanwhile (answers, workflows, rewards; in abort mode the aborted answers' parsing and
        resubmission) is not the update's critical path and is left out. Any other admin: the
        event-loop thread that runs its calls (found once, on the first publish), whatever
        else that thread runs."""
        mine = thread_cpu_clock()
        admin_cpu = getattr(self.admin, "admin_cpu_s", None)
        if callable(admin_cpu):
            return lambda: mine() + admin_cpu()
        if self._loop_thread is None:
            self._loop_thread = self.run(_current_thread())
        try:
            loop = thread_cpu_clock(self._loop_thread) if isinstance(self._loop_thread, int) else mine
            loop()
        except (OSError, OverflowError):  # not a thread of this process (a runner elsewhere)
            loop = mine
        return mine if loop is mine else (lambda: mine() + loop())

    def _set_versions(self, version: int) -> None:
        for party in self.parties:
            party.set_version(version)

    # ----------------------------------------------------------- overridable

    def call(self, make_coro: Callable[[], Coroutine[object, object, T]], version: int, what: str) -> T:
        """Run an admin call on the servers in rotation; the ones that are gone are dropped."""
        return call_dropping_dead(self.run, self.admin, make_coro, version, what)

    def verify(self, version: int) -> dict[str, float]:
        """Check that every server holds ``version`` (rank 0, servers paused); raise if not."""
        if self.verifier is None:
            return {}
        return self.verifier.verify(version, lambda make_coro, what: self.call(make_coro, version, what))

    def _check_serving(self, version: int) -> dict[str, float]:
        """The checks that generate (rank 0, servers running); a failure pauses them again."""
        if self.verifier is None:
            return {}
        try:
            return self.verifier.check_serving(
                version, lambda make_coro, what: self.call(make_coro, version, what))
        except BaseException:
            try:
                self.call(self.admin.pause_generation, version, "pause_generation")
            except Exception as e:  # noqa: BLE001 - the check's failure is the one to report
                logger.warning("pausing the servers after a failed check failed too: %s", e)
            raise
