"""Periodic, atomic checkpoints of a whole run, and resuming from the latest complete one.

A checkpoint ``<root>/step_<N>/`` holds the train engine's sharded state (model,
optimizer, LR schedule, RNG, version; written with torch.distributed.checkpoint) and,
per trainer rank, the rollout side: controller state (counters, trajectories produced
but not yet trained on, prompts in flight) and the dataloader position.

Atomicity: everything is written under ``step_<N>.tmp``; once every rank has finished
(and fsynced) its files, rank 0 checks them, writes the ``COMPLETE`` manifest (the list
of files), and renames the directory. Only a directory named ``step_<N>`` whose manifest
and listed files exist counts. Directories are never deleted in place: they are first
renamed to ``*.trash`` (atomic), so a kill in the middle of a cleanup never leaves a
half-deleted checkpoint that still looks complete. Leftover ``*.tmp``/``*.trash``
directories are swept on the next start.

Fault injection for tests: ``AREALITE_FAULT="point:step[@rank],..."`` makes that rank
SIGKILL itself at a point (see ``FAULT_POINTS``).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from arealite.config.schema import RecoverConfig, SaverConfig
from arealite.utils.accounting import epoch_items_from_plain, epoch_items_to_plain
from arealite.utils.checkpoint_manifest import COMPLETE, complete_checkpoints
from arealite.utils.dist import barrier

logger = logging.getLogger("arealite.checkpoint")

ENV_FAULT = "AREALITE_FAULT"
#: ``ckpt_write``: after every rank's shards are on disk, before the manifest and the rename;
#: ``ckpt_renamed``: after the rename, before old checkpoints are cleaned up;
#: ``step``: right after a step's stats record is written, before its checkpoint.
FAULT_POINTS = ("ckpt_write", "ckpt_renamed", "step", "asleep")


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def fault_point(point: str, step: int) -> None:
    """SIGKILL this process if ``AREALITE_FAULT`` names ``point:step`` for this rank (tests only)."""
    spec = os.environ.get(ENV_FAULT)
    if not spec:
        return
    rank = _rank_world()[0]
    for entry in spec.split(","):
        entry = entry.strip()
        where, _, who = entry.partition("@")
        name, _, at = where.partition(":")
        if name not in FAULT_POINTS or not at.isdigit() or (who and not who.isdigit()):
            raise ValueError(
                f"{ENV_FAULT}={spec!r}: bad entry {entry!r}; expected point:step[@rank] "
                f"with point one of {FAULT_POINTS}"
            )
        if name == point and int(at) == step and int(who or 0) == rank:
            print(f"[arealite] {ENV_FAULT}: rank {rank} kills itself at {point}:{step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def _fsync(path: Path) -> None:
    """Flush a file (or a directory entry list) to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(path: Path) -> None:
    """Remove a directory without ever leaving it half-deleted under its own name."""
    trash = path.with_name(path.name + ".trash")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


class Checkpointer:
    """Saves every ``saver.freq_steps`` steps / ``saver.freq_secs`` seconds; resumes per ``recover.mode``."""

    def __init__(self, root: str | Path, saver: SaverConfig, recover: RecoverConfig):
        self.root = Path(root)
        self.saver = saver
        self.recover = recover
        self._last_save_time = time.monotonic()

    # ------------------------------------------------------------------ save
    def due(self, step: int) -> bool:
        """Whether a checkpoint is due after ``step`` (the same answer on every rank).

        Collective only when ``saver.freq_secs`` is set (rank clocks differ, so the ranks
        agree with one tiny all_reduce); by steps alone it is a local decision.
        """
        by_steps = bool(self.saver.freq_steps) and step % self.saver.freq_steps == 0
        if not self.saver.freq_secs:
            return by_steps
        by_time = time.monotonic() - self._last_save_time >= self.saver.freq_secs
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([float(by_time)])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            by_time = bool(t.item())
        return by_steps or by_time

    def maybe_save(self, step: int, engine, controller, loader, force: bool = False) -> Path | None:
        if not (force or self.due(step)):
            return None
        return self.save(step, engine, controller, loader)

    def save(self, step: int, engine, controller, loader) -> Path:
        """Write checkpoint ``step`` atomically (collective: every rank calls it)."""
        rank, world = _rank_world()
        t0 = time.monotonic()
        final = self.root / f"step_{step}"
        tmp = self.root / f"step_{step}.tmp"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        engine.save(tmp / "engine")  # DCP fsyncs its own shard files
        state = epoch_items_to_plain({  # plain data only: it loads with weights_only
            "step": step,
            "world_size": world,
            "controller": controller.state_dict(),
            "dataloader": loader.state_dict(),
        })
        part = tmp / f"rollout_rank{rank}.pt"
        torch.save(state, part)
        _fsync(part)
        engine_extra = tmp / "engine" / f"engine_rank{rank}.pt"
        if engine_extra.is_file():
            _fsync(engine_extra)
        barrier()
        fault_point("ckpt_write", step)
        if rank == 0:
            files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
            expected = [f"rollout_rank{r}.pt" for r in range(world)]
            missing = [f for f in expected if f not in files]
            if missing:
                raise RuntimeError(f"checkpoint {tmp} is missing {missing} after every rank finished writing")
            manifest = tmp / COMPLETE
            manifest.write_text(json.dumps({"step": step, "world_size": world, "files": files}) + "\n")
            _fsync(manifest)
            _fsync(tmp)
            if final.exists():  # a step re-done after an earlier run: swap, never delete in place
                _discard(final)
            os.replace(tmp, final)
            _fsync(self.root)
            fault_point("ckpt_renamed", step)
            self._prune()
            logger.info("checkpoint step %d written to %s in %.1fs", step, final, time.monotonic() - t0)
        barrier()
        self._last_save_time = time.monotonic()
        return final

    def _prune(self) -> None:
        for _, old in complete_checkpoints(self.root)[: -self.saver.keep_last]:
            _discard(old)

    def sweep(self) -> None:
        """Rank 0: remove what a killed run left behind (``*.tmp``, ``*.trash``, checkpoints beyond keep_last)."""
        if not self.root.is_dir():
            return
        for p in self.root.iterdir():
            if p.is_dir() and p.name.startswith("step_") and p.name.endswith((".tmp", ".trash")):
                logger.warning("removing leftover %s from an interrupted checkpoint", p)
                shutil.rmtree(p, ignore_errors=True)
        self._prune()

    # ---------------------------------------------------------------- resume
    def latest(self) -> tuple[int, Path] | None:
        found = complete_checkpoints(self.root)
        return found[-1] if found else None

    def _set_aside(self) -> None:
        """recover.mode=disabled: move old checkpoints out of the way (kept, never resumed)."""
        if not complete_checkpoints(self.root):
            return
        dest = self.root / f"superseded_{time.strftime('%Y%m%d-%H%M%S')}_{os.getpid()}"
        dest.mkdir(parents=True)
        for p in list(self.root.iterdir()):
            if p.name.startswith("step_"):
                os.replace(p, dest / p.name)
        logger.warning("recover.mode=disabled: existing checkpoints moved to %s; starting fresh", dest)

    def check_mode(self) -> None:
        """Fail fast (before any engine is built) if ``recover.mode=required`` finds no checkpoint."""
        if self.recover.mode == "required" and self.latest() is None:
            raise FileNotFoundError(
                f"recover.mode=required but there is no complete checkpoint under {self.root}; "
                "use recover.mode=auto to start fresh when there is none"
            )

    def maybe_resume(self, engine, controller, loader) -> int:
        """Restore the latest complete checkpoint (per ``recover.mode``); returns the step to start from.

        Collective. Rank 0 cleans up and picks the checkpoint; every rank loads that one.
        """
        rank, world = _rank_world()
        mode = self.recover.mode
        if rank == 0:
            self.sweep()
            if mode == "disabled":
                self._set_aside()
            found = self.latest() if mode != "disabled" else None
            choice = [None if found is None else found[0]]
        else:
            choice = [None]
        if dist.is_initialized() and world > 1:
            dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            if mode == "required":
                self.check_mode()
            return 0
        step = int(choice[0])
        path = self.root / f"step_{step}"
        part = path / f"rollout_rank{rank}.pt"
        if not part.is_file():
            raise RuntimeError(
                f"checkpoint {path} has no {part.name}: it was written by fewer trainer ranks than this run's "
                f"{world}; resume with the same launch.n_trainer_procs"
            )
        state = epoch_items_from_plain(load_state_file(part, allow_pickle=self.recover.allow_pickle))
        if state["world_size"] != world:
            raise RuntimeError(
                f"checkpoint {path} was written by {state['world_size']} trainer rank(s), this run has {world}; "
                "resume with the same launch.n_trainer_procs"
            )
        engine.load(path / "engine")
        engine.set_version(step)
        controller.load_state_dict(state["controller"])
        loader.load_state_dict(state["dataloader"])
        if rank == 0:
            print(f"[arealite] resumed from {path} (step {step})", flush=True)
        return step


def load_state_file(path: Path, allow_pickle: bool = False) -> Any:
    """A ``torch.save``d state of tensors and plain Python data (dicts, lists, tuples, str,
    numbers, None), read without running code the file could name (``weights_only``).

    A file that names any other class is refused with a clear error unless ``allow_pickle``
    (`recover.allow_pickle`: the run directory is trusted)."""
    try:
        return torch.load(path, weights_only=not allow_pickle, map_location="cpu")
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise RuntimeError(
            f"checkpoint file {path} holds objects other than tensors and plain Python data ({first}); "
            "loading it could run code. If you wrote it and no one else can write the run directory, "
            "set recover.allow_pickle: true"
        ) from None
