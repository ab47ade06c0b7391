"""Build the reasoning-gym CPU demo offline: a tiny model, and a short supervised warm-up.

    python examples/reasoning_gym/prepare.py --out runs/rg_demo

The task is reasoning-gym's ``spell_backward`` (short words), generated exactly as
``data.source: reasoning_gym`` will generate it during the run (the same config section, the
same seed). ``OUT/base_model`` is a random tiny model whose tokenizer has few merges, so that a
word is mostly one token per letter; ``OUT/model`` is the warmed-up starting policy. As in the
reverse-digits demo, only a fraction of the warm-up answers spell the word backward (the rest
copy it), so RL with the task's own score has to find and reinforce the right behaviour.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from tensordict import TensorDict
from transformers import AutoTokenizer

from arealite.algo.sft import build_sft_batch
from arealite.check import load_run_config
from arealite.data.reasoning_gym import reasoning_gym_items
from arealite.models.tiny import build_tiny_model
from arealite.models.supervised_warm_start import demo_arguments, start_demo_dir, supervised_warm_up

CONFIG = Path(__file__).with_name("config.yaml")


def main(argv: list[str] | None = None) -> None:
    p = demo_arguments(__doc__, out="runs/rg_demo", n_eval=200, warmup_steps=400, batch_size=64, lr=1e-3)
    p.add_argument("--reverse-fraction", type=float, default=0.4,
                   help="share of warm-up answers that spell the word backward (the rest copy it)")
    p.add_argument("--vocab", type=int, default=300, help="tokenizer size (few merges: letters stay tokens)")
    args = p.parse_args(argv)
    out = start_demo_dir(args)
    if out is None:
        return
    cfg = load_run_config(CONFIG, [f"experiment.seed={args.seed}"], check_paths=False)
    train, _ = reasoning_gym_items(cfg.data.reasoning_gym, cfg.experiment.seed)
    items = [dict(r) for r in train]
    words = [r["reasoning_gym"]["entry"]["question"].rsplit(":", 1)[1].strip() for r in items]
    corpus = [r["prompt"] + " " + r["answer"] for r in items] + words
    base = build_tiny_model(out / "base_model", size=args.size, seed=args.seed, extra_corpus=corpus,
                            vocab_size=args.vocab)
    tok = AutoTokenizer.from_pretrained(base)
    print(f"[prepare] model {base}, {len(items)} train prompts, e.g. {items[0]['prompt']!r} -> {items[0]['answer']!r}")

    def next_batch(rng: random.Random) -> TensorDict:
        rows = [rng.randrange(len(items)) for _ in range(args.batch_size)]
        answers = [items[i]["answer"] if rng.random() < args.reverse_fraction else words[i] for i in rows]
        return build_sft_batch(tok, [items[i]["prompt"] for i in rows], [" " + a for a in answers])

    supervised_warm_up(base, out / "model", next_batch, steps=args.warmup_steps, lr=args.lr, seed=args.seed)
    print(f"[prepare] warmed-up starting policy written to {out / 'model'}")


if __name__ == "__main__":
    sys.exit(main())
