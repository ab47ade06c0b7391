"""Training throughput: a PPO update through FSDPEngine.train_batch vs a plain PyTorch loop.

Both sides train the same tiny HF model from the same weights on the same
tokens with the same AdamW and the same PPO loss (``arealite.algo.loss.
ppo_actor_loss``), one optimizer step per batch, under the same token budget
per micro-batch. The baseline is the loop one writes by hand: right-padded
micro-batches of whole rows (as many rows as fit the budget at the padded
length), forward, loss, backward, clip, step. The engine packs sequences
without padding (first-fit-decreasing under the budget, per-sequence attention).

Two settings: all sequences at the maximum length (packing cannot help; the
engine's overhead shows) and lengths spread over 10%..100% of the maximum
(padding waste is what packing removes). Steps of the two sides alternate
(and swap order every step), so both see the same machine load. The speedup is
the median over steps of (plain time / engine time) on the same batch, a paired
figure that machine noise hits on both sides alike; tokens/s are from each
side's fastest step (other load on a shared machine only ever adds time).

    python benchmarks/bench_train.py [--quick] [--model small|base] [--threads N]

The last line of output is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arealite.algo.loss import loss_weight, ppo_actor_loss  # noqa: E402
from arealite.config.schema import ActorConfig  # noqa: E402
from arealite.engine.fsdp import FSDPEngine  # noqa: E402
from arealite.models.tiny import build_tiny_model  # noqa: E402

LR = 1e-5
PROMPT_FRACTION = 0.25


def ppo_batch(B: int, L: int, vocab: int, varying: bool, seed: int) -> dict[str, torch.Tensor]:
    """A right-padded PPO batch: prompt + completion tokens, behaviour log-probs, advantages."""
    g = torch.Generator().manual_seed(seed)
    if varying:
        lengths = torch.randint(max(2, L // 10), L + 1, (B,), generator=g)
    else:
        lengths = torch.full((B,), L)
    pos = torch.arange(L)[None, :]
    am = pos < lengths[:, None]
    prompt = (lengths.float() * PROMPT_FRACTION).long().clamp(min=1)
    loss_mask = am & (pos >= prompt[:, None])
    ids = torch.randint(5, vocab, (B, L), generator=g) * am
    logprobs = -torch.rand(B, L, generator=g) * 3 * loss_mask
    adv = torch.randn(B, generator=g)[:, None] * loss_mask
    return {"input_ids": ids, "attention_mask": am, "loss_mask": loss_mask, "logprobs": logprobs, "advantages": adv}


def engine_loss(logits, mb):
    return ppo_actor_loss(logits, mb, temperature=1.0, use_decoupled_loss=False)


def engine_weight(mb):
    return loss_weight(mb["loss_mask"])


class PlainLoop:
    """The hand-written baseline: HF model, padded micro-batches of rows, AdamW."""

    def __init__(self, model_dir: Path, mb_max_tokens: int, clip: float):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=0.01)
        self.mb_max_tokens = mb_max_tokens
        self.clip = clip

    def step(self, batch: dict[str, torch.Tensor]) -> tuple[float, int]:
        """One optimizer step; returns the loss and the tokens computed (padding included)."""
        B, L = batch["input_ids"].shape
        rows_per_mb = max(1, self.mb_max_tokens // L)
        total = float(batch["loss_mask"][:, 1:].sum())
        self.opt.zero_grad(set_to_none=True)
        loss_sum, computed = 0.0, 0
        for s in range(0, B, rows_per_mb):
            rows = slice(s, s + rows_per_mb)
            # Trim the micro-batch to its own longest row: what a careful hand loop does.
            width = int(batch["attention_mask"][rows].sum(1).max())
            ids = batch["input_ids"][rows, :width]
            am = batch["attention_mask"][rows, :width]
            logits = self.model(input_ids=ids, attention_mask=am, use_cache=False).logits[:, :-1]
            mb = {
                "labels": ids[:, 1:],
                "loss_mask": batch["loss_mask"][rows, 1:width],
                "logprobs": batch["logprobs"][rows, 1:width],
                "advantages": batch["advantages"][rows, 1:width],
            }
            loss = ppo_actor_loss(logits.float(), mb, temperature=1.0, use_decoupled_loss=False)
            w = float(mb["loss_mask"].sum())
            (loss * (w / total)).backward()
            loss_sum += loss.item() * w
            computed += ids.numel()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        return loss_sum / total, computed


def run_setting(name, model_dir, vocab, B, L, mb_max_tokens, steps, varying, seed) -> dict:
    cfg = ActorConfig(model_path=str(model_dir), mb_max_tokens=mb_max_tokens)
    cfg.optimizer.lr = LR
    engine = FSDPEngine(cfg).initialize()
    plain = PlainLoop(model_dir, mb_max_tokens, cfg.optimizer.gradient_clipping)
    t_eng, t_plain, step_tokens = [], [], []
    real = computed_plain = computed_eng = 0
    losses = []
    try:
        for step in range(steps + 1):  # step 0 warms up both sides and is not timed
            batch = ppo_batch(B, L, vocab, varying, seed + step)
            if step % 2:
                t0 = time.perf_counter()
                loss_plain, computed = plain.step(batch)
                t1 = time.perf_counter()
                stats = engine.train_batch(batch, engine_loss, engine_weight)
                t2 = time.perf_counter()
                dt_plain, dt_eng = t1 - t0, t2 - t1
            else:
                t0 = time.perf_counter()
                stats = engine.train_batch(batch, engine_loss, engine_weight)
                t1 = time.perf_counter()
                loss_plain, computed = plain.step(batch)
                t2 = time.perf_counter()
                dt_eng, dt_plain = t1 - t0, t2 - t1
            losses.append((stats["loss"], loss_plain))
            if step == 0:
                continue
            t_eng.append(dt_eng)
            t_plain.append(dt_plain)
            step_tokens.append(int(stats["n_tokens"]))
            real += int(stats["n_tokens"])
            # The engine computes every real token once plus one token per dummy micro-batch (none here).
            computed_eng += int(stats["n_tokens"])
            computed_plain += computed
    finally:
        engine.destroy()
    # Each step has a fresh batch; a step's throughput is its real tokens over
    # its time, and the best step of each side is reported.
    tokens_per_step = real / steps
    eng_tps = max(n / t for n, t in zip(step_tokens, t_eng))
    plain_tps = max(n / t for n, t in zip(step_tokens, t_plain))
    median_ratio = statistics.median(p / e for p, e in zip(t_plain, t_eng))
    # Same weights, same data: the first step's losses agree (later ones drift by fp rounding only).
    loss_gap = abs(losses[0][0] - losses[0][1])
    return {
        "setting": name,
        "tokens_per_step": tokens_per_step,
        "engine_tokens_per_s": eng_tps,
        "plain_tokens_per_s": plain_tps,
        "speedup": median_ratio,
        "speedup_best_steps": eng_tps / plain_tps,
        "engine_packing_efficiency": real / computed_eng,
        "plain_packing_efficiency": real / computed_plain,
        "first_step_loss_gap": loss_gap,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a short run (small batch, few steps)")
    p.add_argument("--model", default="small", choices=["micro", "small", "base"])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    B, L, steps, budget = (16, 128, 3, 1024) if args.quick else (32, 256, 8, 2048)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", size=args.model, seed=0)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        results = [
            run_setting("uniform", model_dir, vocab, B, L, budget, steps, varying=False, seed=0),
            run_setting("varying", model_dir, vocab, B, L, budget, steps, varying=True, seed=100),
        ]

    goals = {"uniform": 0.9, "varying": 1.3}
    print(f"PPO update throughput, model={args.model}, B={B}, max_len={L}, mb_max_tokens={budget}, "
          f"{steps} timed steps, {torch.get_num_threads()} threads")
    print(f"{'setting':<9} {'engine tok/s':>13} {'plain tok/s':>12} {'speedup':>8} {'goal':>5} "
          f"{'best/best':>9} {'eff engine':>11} {'eff plain':>10} {'loss gap':>9}")
    for r in results:
        print(f"{r['setting']:<9} {r['engine_tokens_per_s']:>13.0f} {r['plain_tokens_per_s']:>12.0f} "
              f"{r['speedup']:>8.2f} {goals[r['setting']]:>5.1f} {r['speedup_best_steps']:>9.2f} "
              f"{r['engine_packing_efficiency']:>11.2f} "
              f"{r['plain_packing_efficiency']:>10.2f} {r['first_step_loss_gap']:>9.1e}")
    summary = {
        "benchmark": "bench_train",
        "model": args.model,
        "quick": args.quick,
        "batch_size": B,
        "max_len": L,
        "mb_max_tokens": budget,
        "steps": steps,
        "threads": torch.get_num_threads(),
    }
    for r in results:
        s = r["setting"]
        summary[f"{s}_engine_tokens_per_s"] = round(r["engine_tokens_per_s"], 1)
        summary[f"{s}_plain_tokens_per_s"] = round(r["plain_tokens_per_s"], 1)
        summary[f"{s}_speedup"] = round(r["speedup"], 3)
        summary[f"{s}_speedup_best_steps"] = round(r["speedup_best_steps"], 3)
        summary[f"{s}_goal"] = goals[s]
        summary[f"{s}_engine_packing_efficiency"] = round(r["engine_packing_efficiency"], 3)
        summary[f"{s}_plain_packing_efficiency"] = round(r["plain_packing_efficiency"], 3)
        summary[f"{s}_first_step_loss_gap"] = r["first_step_loss_gap"]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
