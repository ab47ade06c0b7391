"""Build the CPU demo offline: a tiny model, the data, and a short supervised warm-up.

    python examples/reverse_digits/prepare.py --out runs/demo

writes ``OUT/base_model`` (random tiny Qwen2-style model + locally trained tokenizer),
``OUT/train.jsonl`` / ``OUT/eval.jsonl`` (disjoint digit strings), and ``OUT/model``: the
warmed-up starting policy for RL.

The warm-up data is deliberately imperfect: only a fraction of its answers reverse the
digits, the rest just copy them. The starting policy therefore reverses only sometimes
(it solves some held-out prompts, not most); RL with the verifiable reward has to find
and reinforce the right behaviour. The warm-up runs on the same FSDP2 train engine as
RL, with the supervised cross-entropy loss.
"""

from __future__ import annotations

import argparse
import logging
import random
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from arealite.algo.sft import build_sft_batch, sft_loss_fn, sft_loss_weight
from arealite.config.schema import ActorConfig, OptimizerConfig
from arealite.engine.fsdp import FSDPEngine
from arealite.models.tiny import build_tiny_model
from arealite.reward.reverse_digits import make_items, write_jsonl


def warm_up(model_dir: Path, out_dir: Path, items: list[dict], steps: int, batch_size: int,
            reverse_fraction: float, lr: float, seed: int) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = ActorConfig(
        model_path=str(model_dir), mb_max_tokens=4096,
        optimizer=OptimizerConfig(lr=lr, weight_decay=0.0, beta2=0.98, warmup_steps=min(100, steps // 4),
                                  lr_scheduler="constant", gradient_clipping=1.0),
    )
    engine = FSDPEngine(cfg).initialize(total_steps=steps)
    rng = random.Random(seed)
    t0 = time.time()
    for step in range(1, steps + 1):
        rows = [rng.choice(items) for _ in range(batch_size)]
        answers = [r["answer"] if rng.random() < reverse_fraction else r["digits"] for r in rows]
        batch = build_sft_batch(tok, [r["prompt"] for r in rows], [" " + a for a in answers])
        stats = engine.train_batch(batch, sft_loss_fn, sft_loss_weight)
        if step % 50 == 0 or step == steps:
            print(f"[warm-up] step {step}/{steps}  nll {stats.get('sft_nll', stats.get('loss', 0.0)):.3f}  "
                  f"({time.time() - t0:.0f}s)", flush=True)
    engine.export_hf(out_dir)
    engine.destroy()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/demo", help="directory for the model and data")
    p.add_argument("--size", default="small", help="tiny model size (micro|small|base|large)")
    p.add_argument("--n-train", type=int, default=4000)
    p.add_argument("--n-eval", type=int, default=200)
    p.add_argument("--warmup-steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--reverse-fraction", type=float, default=0.4,
                   help="share of warm-up answers that reverse (the rest copy)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if OUT/model exists")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(args.seed)

    out = Path(args.out)
    if (out / "model" / "config.json").exists() and not args.force:
        print(f"[prepare] {out / 'model'} exists; reusing it (pass --force to rebuild)")
        return
    out.mkdir(parents=True, exist_ok=True)
    base = build_tiny_model(out / "base_model", size=args.size, seed=args.seed)
    eval_items = make_items(args.n_eval, seed=args.seed + 1000)
    train_items = make_items(args.n_train, seed=args.seed, exclude={it["digits"] for it in eval_items})
    write_jsonl(train_items, out / "train.jsonl")
    write_jsonl(eval_items, out / "eval.jsonl")
    print(f"[prepare] model {base}, {len(train_items)} train / {len(eval_items)} held-out prompts")
    tmp = out / "model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    warm_up(base, tmp, train_items, args.warmup_steps, args.batch_size, args.reverse_fraction, args.lr, args.seed)
    shutil.rmtree(out / "model", ignore_errors=True)
    tmp.rename(out / "model")
    print(f"[prepare] warmed-up starting policy written to {out / 'model'}")


if __name__ == "__main__":
    main()
