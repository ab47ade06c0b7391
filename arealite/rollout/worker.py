"""The rollout side of a trainer rank in a child process: `RolloutWorker`.

Python runs one thread at a time per process (the GIL). In the trainer's process, every
response the rollout handles (HTTP, decode, reward hand-back, trajectory building) takes
the GIL from the training step that runs meanwhile: asynchronous RL then trains slower
than synchronous RL by the rollout's whole CPU time. `RolloutWorker` runs the client, the
`RolloutController`, the dataloader and the workflows (a `LocalRollout`) in a child
process with its own GIL, on the inference servers' cores when the launcher pins them
(``AREALITE_ROLLOUT_CPUS``), and forwards the trainer's calls to it over a pipe:
a batch, pause/resume, the version, stats, evaluation, checkpoint state.

The weight publisher's administration calls do not cross the pipe: the trainer keeps a
client of its own for them (`admin`, `run`). The child dies with the trainer (Linux
parent-death signal), and a dead child is an error naming its exit code, never a hang.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe
from typing import TYPE_CHECKING, Any

from arealite.api.contracts import InferenceClient, Runner, StateDict, WeightUpdateAdmin
from arealite.config.run import ENV_ROLLOUT_CPUS
from arealite.config.schema import ArealiteConfig
from arealite.rollout.loop_thread import LoopThread
from arealite.utils.json_types import JsonObject
from arealite.utils.procs import die_with_parent
from arealite.workflow.base import RolloutWorkflow

if TYPE_CHECKING:
    from tensordict import TensorDictBase

    from arealite.rollout.side import LocalRollout
    from arealite.utils.accounting import EpochTagged

logger = logging.getLogger("arealite.rollout")


class RolloutWorkerError(RuntimeError):
    """The rollout child raised (its traceback is in the message) or died."""


@dataclass
class WorkerSpec:
    """What the child needs to build its `LocalRollout` (pickled once, at start).

    ``workflow``/``eval_workflow`` None: built in the child from ``rollout.workflow``.
    """

    config: ArealiteConfig
    world_size: int
    loader: EpochTagged
    workflow: RolloutWorkflow | None = None
    eval_workflow: RolloutWorkflow | None = None


def _build_side(spec: WorkerSpec) -> LocalRollout:
    from transformers import AutoTokenizer

    from arealite.rollout.build import build_local_rollout

    cfg = spec.config
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor.model_path)
    return build_local_rollout(cfg, tokenizer, spec.loader, spec.world_size, spec.workflow, spec.eval_workflow)


def _batch_with_extras(side: LocalRollout) -> tuple[TensorDictBase, list[JsonObject], list[JsonObject]]:
    """A batch, the items it came from and the items dropped since the last batch, in one
    round trip over the pipe (the trainer reads all three)."""
    batch = side.prepare_batch()
    return batch, side.last_batch_items, side.take_dropped()


#: Calls answered in the child by more than the `LocalRollout` method of that name (one
#: round trip instead of several).
_COMBINED = {"prepare_batch": _batch_with_extras}

#: Calls the trainer may make on the child's `LocalRollout` (the attribute reads included).
_CALLS = {"start", "prepare_batch", "take_dropped", "pause", "resume", "set_version", "stats",
          "unfinished_state", "epochs_handed_out", "eval_sums", "stop",
          "controller.state_dict", "controller.load_state_dict", "loader.state_dict",
          "loader.load_state_dict"}


def _send(conn: Connection, obj: object) -> None:
    # Plain pickle: multiprocessing's own would pass tensors as shared-memory handles, which
    # a process it did not start cannot open.
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _child_main(conn: Connection, spec: WorkerSpec) -> None:
    """The child: build the rollout side, then answer the trainer's calls until `stop`."""
    try:
        side = _build_side(spec)
    except BaseException:
        _send(conn, (False, f"building the rollout side failed:\n{traceback.format_exc()}"))
        return
    _send(conn, (True, None))
    while True:
        try:
            name, args = _recv(conn)
        except (EOFError, OSError):  # the trainer is gone
            side.stop()
            return
        try:
            if name in _COMBINED:
                result = _COMBINED[name](side, *args)
            else:
                target: Any = side
                for part in name.split("."):
                    target = getattr(target, part)
                result = target(*args) if callable(target) else target
            _send(conn, (True, result))
        except BaseException as e:  # reported to the trainer, which raises it there
            _send(conn, (False, f"{type(e).__name__}: {e}\n--- in the rollout worker:\n{traceback.format_exc()}"))
        if name == "stop":
            return


def child_entry(fd: int) -> None:
    """``python -c "...child_entry(FD)"``: the child process's start (see `RolloutWorker`)."""
    die_with_parent(signal.SIGKILL)
    faulthandler.enable()  # a crash in native code leaves every thread's stack in the trainer log
    cpus = os.environ.get(ENV_ROLLOUT_CPUS)
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    conn = Connection(fd)
    try:
        spec = _recv(conn)
    except Exception:  # e.g. a workflow class the child cannot import
        _send(conn, (False, f"the rollout worker could not read its spec:\n{traceback.format_exc()}"))
        return
    _child_main(conn, spec)


def runs_in_a_worker(*workflows: RolloutWorkflow | None) -> str | None:
    """Why these workflow objects cannot go to a worker process (None when they can)."""
    for wf in workflows:
        if wf is None:
            continue
        if type(wf).__module__ == "__main__":
            return (f"{type(wf).__name__} is defined in the script run as __main__, which the worker "
                    "process does not run; define it in a module to use rollout.worker=process")
        try:
            pickle.dumps(wf)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            return f"{type(wf).__name__} cannot be pickled ({e})"
    return None


class CoreMigration:
    """Moves the rollout worker to the trainer's cores when the trainer waits for batches.

    The worker starts beside the servers (``AREALITE_ROLLOUT_CPUS``), which is right when
    training is the longer phase: generation leaves room on the servers' cores. When the
    trainer instead waits for batches (synchronous RL, or generation the longer phase), the
    servers' cores are the bottleneck and the trainer's own are idle while it waits: the
    first window of `window` steps in which the trainer waited more than `threshold` of
    the time moves the worker's threads there, for good (moving back and forth would chase
    its own effect).
    """

    def __init__(self, pid: int, to_cpus: set[int], window: int = 5, warmup: int = 2,
                 threshold: float = 0.1):
        self.pid, self.to_cpus = pid, to_cpus
        self.window, self.warmup, self.threshold = window, warmup, threshold
        self.steps = 0
        self.wait = self.total = 0.0
        self.moved = False

    def observe(self, wait_s: float, step_s: float) -> None:
        """One step: `wait_s` of `step_s` were spent waiting for the batch."""
        self.steps += 1
        if self.moved or self.steps <= self.warmup:
            return
        self.wait += wait_s
        self.total += step_s
        if (self.steps - self.warmup) % self.window:
            return
        if self.total > 0 and self.wait / self.total > self.threshold:
            self._move()
            self.moved = True
        self.wait = self.total = 0.0  # the next window

    def _move(self) -> None:
        try:
            for tid in os.listdir(f"/proc/{self.pid}/task"):
                os.sched_setaffinity(int(tid), self.to_cpus)
        except OSError as e:  # the worker is gone or the cores are not ours: keep the placement
            logger.warning("could not move the rollout worker to cores %s: %s", sorted(self.to_cpus), e)
            return
        logger.warning("the trainer waited %.0f%% of each step for batches: the rollout worker moved "
                       "to the trainer's cores %s", 100 * self.wait / self.total, sorted(self.to_cpus))


class _Remote:
    """A stateful object of the child (its controller or dataloader), for the checkpointer."""

    def __init__(self, worker: "RolloutWorker", name: str):
        self._worker, self._name = worker, name

    def state_dict(self) -> StateDict:
        return self._worker.call(f"{self._name}.state_dict")

    def load_state_dict(self, state: StateDict) -> None:
        self._worker.call(f"{self._name}.load_state_dict", state)


class RolloutWorker:
    """The `RolloutSide` of a rank, run by a child process (see the module docstring)."""

    def __init__(self, spec: WorkerSpec, admin_client: InferenceClient, start_timeout: float = 600.0):
        # A fresh interpreter, not a fork of one that holds threads and process groups, and
        # not multiprocessing's spawn, which would run the user's training script again.
        self._conn, child_conn = Pipe(duplex=True)
        code = f"from arealite.rollout.worker import child_entry; child_entry({child_conn.fileno()})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[child_conn.fileno()],
                                     stdin=subprocess.DEVNULL)
        child_conn.close()
        self._stopped = False
        self._cores = (CoreMigration(self.proc.pid, os.sched_getaffinity(0))
                           if os.environ.get(ENV_ROLLOUT_CPUS) and hasattr(os, "sched_getaffinity") else None)
        self._last_batch_at: float | None = None
        _send(self._conn, spec)
        self._receive("start", start_timeout)
        self.controller_state = _Remote(self, "controller")
        self.loader_state = _Remote(self, "loader")
        self.last_batch_items: list[JsonObject] = []
        # The dropped items the child sent with the last batch, until `take_dropped`; once
        # another call has been made since that batch (`_fresh` false), the child may have newer.
        self._pending_dropped: list[JsonObject] = []
        self._fresh = False
        # The publisher's administration runs here, on a client of the trainer's own.
        self._admin_client = admin_client
        self._loop = LoopThread("arealite-admin")
        self._loop.start()
        self._loop.run(admin_client.initialize())

    # ------------------------------------------------------------------ the pipe
    def call(self, name: str, *args: object, timeout: float | None = None) -> Any:
        """Call ``name`` on the child's `LocalRollout` and return its result (raises its error)."""
        if name not in _CALLS:
            raise ValueError(f"unknown rollout worker call {name!r}")
        if self._stopped:
            raise RolloutWorkerError(f"the rollout worker was stopped; {name} cannot run")
        self._fresh = False
        try:
            _send(self._conn, (name, args))
        except OSError as e:  # a broken pipe: the child is gone
            code = self.proc.poll()
            raise RolloutWorkerError(f"the rollout worker (pid {self.proc.pid}) cannot take {name}: {e} "
                                     f"(exit code {code})") from None
        return self._receive(name, timeout)

    def _receive(self, name: str, timeout: float | None) -> Any:
        waited = 0.0
        while not self._conn.poll(1.0):
            waited += 1.0
            if self.proc.poll() is not None:
                raise self._died(name)
            if timeout is not None and waited >= timeout:
                raise RolloutWorkerError(f"the rollout worker did not answer {name} within {timeout:.0f}s")
        try:
            ok, value = _recv(self._conn)
        except (EOFError, OSError) as e:
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                raise RolloutWorkerError(f"the rollout worker's pipe closed during {name}: {e}") from None
            raise self._died(name) from None
        if not ok:
            raise RolloutWorkerError(value)
        return value

    def _died(self, name: str) -> RolloutWorkerError:
        return RolloutWorkerError(f"the rollout worker (pid {self.proc.pid}) died with exit code "
                                  f"{self.proc.returncode} during {name}; see the trainer log")

    # ------------------------------------------------------------------ RolloutSide
    @property
    def admin(self) -> WeightUpdateAdmin:
        return self._admin_client.admin  # type: ignore[attr-defined]

    @property
    def run(self) -> Runner:
        return self._loop.run

    def start(self, version: int) -> None:
        self.call("start", version)

    def prepare_batch(self) -> TensorDictBase:
        t0 = time.monotonic()
        batch, self.last_batch_items, dropped = self.call("prepare_batch")
        self._pending_dropped.extend(dropped)
        self._fresh = True
        now = time.monotonic()
        if self._cores is not None and self._last_batch_at is not None:
            self._cores.observe(now - t0, now - self._last_batch_at)
        self._last_batch_at = now
        return batch

    def take_dropped(self) -> list[JsonObject]:
        """Items dropped since the last call: those sent with the last batch, and, once any
        other call has been made since that batch, the child's newer ones."""
        out, self._pending_dropped = self._pending_dropped, []
        if not self._fresh:
            out += self.call("take_dropped")
        return out

    def pause(self) -> None:
        self.call("pause")

    def resume(self) -> None:
        self.call("resume")

    def set_version(self, version: int) -> None:
        self.call("set_version", version)

    def stats(self) -> dict[str, JsonObject]:
        return self.call("stats")

    def unfinished_state(self) -> StateDict:
        return self.call("unfinished_state")

    def epochs_handed_out(self) -> int:
        return self.call("epochs_handed_out")

    def eval_sums(self, items: Sequence[JsonObject], ks: Sequence[int] = ()) -> dict[str, float]:
        return self.call("eval_sums", list(items), list(ks))

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the child's controller and the child, then the admin client; safe to call twice."""
        if self._stopped:
            return
        try:
            if self.proc.poll() is None:
                self.call("stop", timeout=timeout)
        except RolloutWorkerError as e:
            logger.warning("stopping the rollout worker: %s", e)
        finally:
            self._stopped = True
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
            self._conn.close()
            self._loop.stop(self._admin_client.aclose, timeout)
