"""A short supervised warm-up of a tiny model: the starting policy of the CPU demos.

RL from a random model learns nothing (no sample earns a reward), so each demo first trains
its tiny model on deliberately imperfect traces with the supervised loss, on the same FSDP2
train engine as RL. The demo decides what a batch holds; this module runs the steps, shows
progress and writes the policy only once it is complete.
"""

from __future__ import annotations

import argparse
import logging
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tensordict import TensorDict

from arealite.algo.sft import sft_loss_fn, sft_loss_weight
from arealite.config.schema import ActorConfig, OptimizerConfig
from arealite.train_engine.fsdp import FSDPEngine

__all__ = ["demo_arguments", "start_demo_dir", "supervised_warm_up"]


def supervised_warm_up(model_dir: Path, out_dir: Path, next_batch: Callable[[random.Random], TensorDict], *,
                       steps: int, lr: float, seed: int, mb_max_tokens: int = 4096,
                       lr_warmup_steps: int = 100, log_every: int = 50) -> None:
    """Train ``model_dir`` for ``steps`` batches of ``next_batch(rng)`` (a packed SFT batch, see
    `arealite.algo.sft`) and export the result to ``out_dir``.

    The export goes to a sibling directory renamed to ``out_dir`` at the end, so an interrupted
    warm-up never leaves a half-written policy where the demo looks for one."""
    cfg = ActorConfig(
        model_path=str(model_dir), mb_max_tokens=mb_max_tokens,
        optimizer=OptimizerConfig(lr=lr, weight_decay=0.0, beta2=0.98, warmup_steps=min(lr_warmup_steps, steps // 4),
                                  lr_scheduler="constant", gradient_clipping=1.0),
    )
    engine = FSDPEngine(cfg).initialize(total_steps=steps)
    rng = random.Random(seed)
    t0 = time.time()
    for step in range(1, steps + 1):
        stats = engine.train_batch(next_batch(rng), sft_loss_fn, sft_loss_weight)
        if step % log_every == 0 or step == steps:
            print(f"[warm-up] step {step}/{steps}  nll {stats.get('sft_nll', stats.get('loss', 0.0)):.3f}  "
                  f"({time.time() - t0:.0f}s)", flush=True)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    engine.export_hf(tmp)
    engine.destroy()
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


def demo_arguments(doc: str | None, *, out: str, n_eval: int, warmup_steps: int, batch_size: int,
                   lr: float) -> argparse.ArgumentParser:
    """The options every demo's ``prepare.py`` has, with that demo's defaults; it adds its own."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=out, help="directory for the model and data")
    p.add_argument("--size", default="small", help="tiny model size (micro|small|base|large)")
    p.add_argument("--n-train", type=int, default=4000)
    p.add_argument("--n-eval", type=int, default=n_eval)
    p.add_argument("--warmup-steps", type=int, default=warmup_steps)
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if OUT/model exists")
    return p


def start_demo_dir(args: argparse.Namespace) -> Path | None:
    """``args.out`` made ready for a new build, or None when its policy exists (reused unless
    ``--force``). Seeds torch for the model's random initialisation."""
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    if (out / "model" / "config.json").exists() and not args.force:
        print(f"[prepare] {out / 'model'} exists; reusing it (pass --force to rebuild)")
        return None
    out.mkdir(parents=True, exist_ok=True)
    return out
