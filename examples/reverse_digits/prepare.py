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

import random
from pathlib import Path

from tensordict import TensorDict
from transformers import AutoTokenizer

from arealite.algo.sft import build_sft_batch
from arealite.models.tiny import build_tiny_model
from arealite.models.supervised_warm_start import demo_arguments, start_demo_dir, supervised_warm_up
from arealite.reward.reverse_digits import make_items, write_jsonl


def warm_up(model_dir: Path, out_dir: Path, items: list[dict], steps: int, batch_size: int,
            reverse_fraction: float, lr: float, seed: int) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)

    def next_batch(rng: random.Random) -> TensorDict:
        rows = [rng.choice(items) for _ in range(batch_size)]
        answers = [r["answer"] if rng.random() < reverse_fraction else r["digits"] for r in rows]
        return build_sft_batch(tok, [r["prompt"] for r in rows], [" " + a for a in answers])

    supervised_warm_up(model_dir, out_dir, next_batch, steps=steps, lr=lr, seed=seed)


def main(argv: list[str] | None = None) -> None:
    p = demo_arguments(__doc__, out="runs/demo", n_eval=200, warmup_steps=400,
                       batch_size=64, lr=1e-3)
    p.add_argument("--reverse-fraction", type=float, default=0.4,
                   help="share of warm-up answers that reverse (the rest copy)")
    args = p.parse_args(argv)
    out = start_demo_dir(args)
    if out is None:
        return
    base = build_tiny_model(out / "base_model", size=args.size, seed=args.seed)
    eval_items = make_items(args.n_eval, seed=args.seed + 1000)
    train_items = make_items(args.n_train, seed=args.seed, exclude={it["digits"] for it in eval_items})
    write_jsonl(train_items, out / "train.jsonl")
    write_jsonl(eval_items, out / "eval.jsonl")
    print(f"[prepare] model {base}, {len(train_items)} train / {len(eval_items)} held-out prompts")
    warm_up(base, out / "model", train_items, args.warmup_steps, args.batch_size, args.reverse_fraction, args.lr,
            args.seed)
    print(f"[prepare] warmed-up starting policy written to {out / 'model'}")


if __name__ == "__main__":
    main()
