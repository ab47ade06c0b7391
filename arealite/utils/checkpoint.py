"""Periodic, atomic checkpoints of a whole run, and resuming from the latest complete one.

A checkpoint ``<root>/step_<N>/`` holds the train engine's sharded state (model,
optimizer, LR schedule, RNG, version; written with torch.distributed.checkpoint) and,
per trainer rank, the rollout side: controller state (counters, trajectories produced
but not yet trained on, prompts in flight) and the dataloader position. It is written
under ``step_<N>.tmp`` and renamed only when every rank has finished, so a half-written
checkpoint is never taken for a good one. The last ``saver.keep_last`` are kept.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from arealite.config.schema import RecoverConfig, SaverConfig

logger = logging.getLogger("arealite.checkpoint")

_COMPLETE = "COMPLETE"


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint under ``root``, oldest first."""
    out = []
    r = Path(root)
    if not r.is_dir():
        return out
    for p in r.iterdir():
        if p.is_dir() and p.name.startswith("step_") and not p.name.endswith(".tmp") and (p / _COMPLETE).exists():
            try:
                out.append((int(p.name[len("step_"):]), p))
            except ValueError:
                continue
    return sorted(out)


class Checkpointer:
    """Saves every ``saver.freq_steps`` steps / ``saver.freq_secs`` seconds; resumes per ``recover.mode``."""

    def __init__(self, root: str | Path, saver: SaverConfig, recover: RecoverConfig):
        self.root = Path(root)
        self.saver = saver
        self.recover = recover
        self._last_save_time = time.monotonic()

    # ------------------------------------------------------------------ save
    def due(self, step: int) -> bool:
        """Whether a checkpoint is due after ``step`` (the same answer on every rank)."""
        by_steps = bool(self.saver.freq_steps) and step % self.saver.freq_steps == 0
        by_time = bool(self.saver.freq_secs) and time.monotonic() - self._last_save_time >= self.saver.freq_secs
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([float(by_time)])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # rank clocks differ: agree
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
        _barrier()
        engine.save(tmp / "engine")
        state = {
            "step": step,
            "world_size": world,
            "controller": controller.state_dict(),
            "dataloader": loader.state_dict(),
        }
        part = tmp / f"rollout_rank{rank}.pt"
        torch.save(state, str(part) + ".part")
        os.replace(str(part) + ".part", part)
        _barrier()
        if rank == 0:
            (tmp / _COMPLETE).write_text(f"step {step}, {world} rank(s)\n")
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for _, old in complete_checkpoints(self.root)[: -self.saver.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
            logger.info("checkpoint step %d written to %s in %.1fs", step, final, time.monotonic() - t0)
        _barrier()
        self._last_save_time = time.monotonic()
        return final

    # ---------------------------------------------------------------- resume
    def latest(self) -> tuple[int, Path] | None:
        found = complete_checkpoints(self.root)
        return found[-1] if found else None

    def maybe_resume(self, engine, controller, loader) -> int:
        """Restore the latest complete checkpoint (per ``recover.mode``); returns the step to start from."""
        mode = self.recover.mode
        found = self.latest() if mode != "disabled" else None
        if found is None:
            if mode == "required":
                raise FileNotFoundError(
                    f"recover.mode=required but no complete checkpoint under {self.root}; "
                    "use recover.mode=auto to start fresh when there is none"
                )
            return 0
        step, path = found
        rank, world = _rank_world()
        state = torch.load(path / f"rollout_rank{rank}.pt", weights_only=False)
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
