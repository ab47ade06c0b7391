"""Training throughput: ``PPOActor.ppo_update`` on FSDPEngine vs a plain PyTorch loop.

Both sides train the same tiny HF model from the same weights on the same
tokens with the same AdamW (same hyper-parameters, gradient clipping) and the
same PPO loss (``PPOActor.loss_fn()``: decoupled PPO, proximal log-probs from the
training forward), one optimizer step per batch, on the CPU, in float32. The
baseline is the loop one writes by hand: the right-padded batch cut into
micro-batches of whole rows under the same token budget (as many rows of the
padded length as fit), forward with the attention mask, loss, backward, clip,
step. The engine packs the real tokens of several sequences into one row per
micro-batch (first-fit-decreasing under the budget, causal attention within
each sequence).

Two settings: (a) every sequence at the maximum length, where packing cannot
help and the engine's overhead shows; (b) lengths drawn uniformly from 10% to
100% of the maximum, where the baseline computes padding that packing drops.

Packing efficiency = real tokens / tokens computed: for the engine the tokens
its forward passes ran (``n_tokens_computed``: packed tokens plus one per dummy
micro-batch), for the baseline batch x max_len.

Rounds alternate between the two sides (the first side swaps every round) on
the same batch, so both see the same machine load; the first round warms up and
is not timed. Tokens/s are the median over rounds of real tokens / step time;
the speedup is the median over rounds of baseline time / engine time, a paired
figure that load on a shared machine hits on both sides alike.

    python benchmarks/bench_train.py [--quick] [--model micro|small|base] [--threads N]
                                     [--attn-impl auto|flex|sdpa_loop|varlen]

The last line of output is one JSON object with every figure and the verdict
against the goals (speedup >= 0.9 with uniform lengths, >= 1.3 with varying).
``--attn-impl`` sets the engine's ``actor.attn_impl`` (default ``auto``: today's
behaviour, the SDPA loop on the CPU).

    python benchmarks/bench_train.py --attn [--quick] [--model ...] [--threads N]

times the packed-attention implementations that run on this device against
``sdpa_loop`` instead: the same HF model and weights loaded with each, the same
packed micro-batches of long-tailed lengths (length = max_len * u^3, u uniform:
many short answers, a few long), forward + backward of every micro-batch (and,
separately, the forward without a graph, as log-prob recomputation runs), each
impl in its own process, one at a time, the order rotating each round; the ratios ``attn_<impl>_over_sdpa_loop`` (time of
``impl`` / time of ``sdpa_loop``, median over rounds of the paired ratio; > 1
means slower) are in the last-line JSON.
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
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arealite.algo.actor import PPOActor  # noqa: E402
from arealite.config.schema import ActorConfig, AlgorithmConfig  # noqa: E402
from arealite.train_engine.attention import ATTN_IMPLS, register_attention, resolve_attn_impl  # noqa: E402
from arealite.train_engine.fsdp import FSDPEngine  # noqa: E402
from arealite.train_engine.packing import split_into_microbatches  # noqa: E402
from arealite.train_engine.lm_head import ChunkedHead  # noqa: E402
from arealite.models.tiny import build_tiny_model  # noqa: E402

LR = 1e-5
PROMPT_FRACTION = 0.25
GOALS = {"uniform": 0.9, "varying": 1.3}


def ppo_batch(B: int, L: int, vocab: int, varying: bool, seed: int) -> TensorDict:
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
    data = {
        "input_ids": torch.randint(5, vocab, (B, L), generator=g) * am,
        "attention_mask": am,
        "loss_mask": loss_mask,
        "logprobs": -torch.rand(B, L, generator=g) * 3 * loss_mask,
        "advantages": torch.randn(B, generator=g)[:, None] * loss_mask,
    }
    return TensorDict(data, batch_size=[B])


class PlainLoop:
    """The hand-written baseline: HF model, padded micro-batches of rows, AdamW."""

    def __init__(self, model_dir: Path, cfg: ActorConfig, loss_fn):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        self.model.train()
        opt = cfg.optimizer
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
            weight_decay=opt.weight_decay,
        )
        self.clip = opt.gradient_clipping
        self.mb_max_tokens = cfg.mb_max_tokens
        self.loss_fn = loss_fn

    def step(self, batch: TensorDict) -> tuple[float, int]:
        """One optimizer step; returns the token-mean loss and the tokens computed (padding included)."""
        B, L = batch["input_ids"].shape
        rows_per_mb = max(1, self.mb_max_tokens // L)
        total = float(batch["loss_mask"][:, 1:].sum())
        self.opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for s in range(0, B, rows_per_mb):
            rows = slice(s, s + rows_per_mb)
            ids = batch["input_ids"][rows]
            logits = self.model(input_ids=ids, attention_mask=batch["attention_mask"][rows], use_cache=False).logits
            # logits[:, t] predicts token t + 1: every per-token key shifts by one.
            mb = {"labels": ids[:, 1:]}
            for k in ("loss_mask", "logprobs", "advantages"):
                mb[k] = batch[k][rows, 1:]
            loss = self.loss_fn(ChunkedHead.from_logits(logits[:, :-1]), mb)
            w = float(mb["loss_mask"].sum())
            (loss * (w / total)).backward()
            loss_sum += loss.item() * w
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        return loss_sum / total, B * L


def run_setting(name: str, model_dir: Path, vocab: int, B: int, L: int, mb_max_tokens: int, rounds: int,
                varying: bool, seed: int, attn_impl: str = "auto") -> dict:
    cfg = ActorConfig(model_path=str(model_dir), mb_max_tokens=mb_max_tokens, attn_impl=attn_impl)
    cfg.optimizer.lr = LR
    engine = FSDPEngine(cfg, device="cpu").initialize()
    actor = PPOActor(AlgorithmConfig(), engine, temperature=1.0)
    plain = PlainLoop(model_dir, cfg, actor.loss_fn())

    def engine_step(batch):
        (stats,) = actor.ppo_update(batch)
        return stats["loss"], int(stats["n_tokens_computed"])

    sides = {"engine": engine_step, "plain": plain.step}
    times: dict[str, list[float]] = {"engine": [], "plain": []}
    computed = {"engine": 0, "plain": 0}
    real_per_round, first_losses = [], {}
    try:
        for r in range(rounds + 1):  # round 0 warms up both sides and is not timed
            batch = ppo_batch(B, L, vocab, varying, seed + r)
            order = ("engine", "plain") if r % 2 == 0 else ("plain", "engine")
            for side in order:
                t0 = time.perf_counter()
                loss, n_computed = sides[side](batch)
                dt = time.perf_counter() - t0
                if r == 0:
                    first_losses[side] = loss
                    continue
                times[side].append(dt)
                computed[side] += n_computed
            if r > 0:
                real_per_round.append(int(batch["attention_mask"].sum()))
    finally:
        engine.destroy()
    real = sum(real_per_round)
    tps = {side: statistics.median(n / t for n, t in zip(real_per_round, times[side])) for side in sides}
    speedup = statistics.median(p / e for p, e in zip(times["plain"], times["engine"]))
    return {
        "setting": name,
        "real_tokens_per_round": real / rounds,
        "engine_tokens_per_s": tps["engine"],
        "plain_tokens_per_s": tps["plain"],
        "speedup": speedup,
        "goal": GOALS[name],
        "goal_met": speedup >= GOALS[name],
        "engine_packing_efficiency": real / computed["engine"],
        "plain_packing_efficiency": real / computed["plain"],
        # Same weights, same data: the warm-up round's losses agree up to float rounding.
        "first_step_loss_gap": abs(first_losses["engine"] - first_losses["plain"]),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a short run (small batch, few rounds)")
    p.add_argument("--model", default="small", choices=["micro", "small", "base"])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--attn-impl", default="auto", choices=list(ATTN_IMPLS), help="the engine's actor.attn_impl")
    p.add_argument("--attn", action="store_true", help="time each packed-attention impl against sdpa_loop instead")
    p.add_argument("--attn-child", nargs=3, metavar=("IMPL", "MODEL_DIR", "N,MAX_LEN,BUDGET"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.attn_child:
        return attention_child(*args.attn_child)
    if args.attn:
        return attention_main(args)
    B, L, rounds, budget = (16, 128, 3, 1024) if args.quick else (32, 256, 7, 2048)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", size=args.model, seed=0)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        results = [
            run_setting("uniform", model_dir, vocab, B, L, budget, rounds, varying=False, seed=0,
                        attn_impl=args.attn_impl),
            run_setting("varying", model_dir, vocab, B, L, budget, rounds, varying=True, seed=100,
                        attn_impl=args.attn_impl),
        ]

    print(f"PPOActor.ppo_update vs a plain PyTorch loop: model={args.model}, B={B}, max_len={L}, "
          f"mb_max_tokens={budget}, {rounds} timed rounds (medians), {torch.get_num_threads()} threads")
    print(f"{'setting':<9} {'engine tok/s':>13} {'plain tok/s':>12} {'speedup':>8} {'goal':>6} {'met':>4} "
          f"{'eff engine':>11} {'eff plain':>10} {'loss gap':>9}")
    for r in results:
        print(f"{r['setting']:<9} {r['engine_tokens_per_s']:>13.0f} {r['plain_tokens_per_s']:>12.0f} "
              f"{r['speedup']:>8.2f} {'>=' + str(r['goal']):>6} {'yes' if r['goal_met'] else 'no':>4} "
              f"{r['engine_packing_efficiency']:>11.3f} {r['plain_packing_efficiency']:>10.3f} "
              f"{r['first_step_loss_gap']:>9.1e}")
    summary = {
        "benchmark": "bench_train",
        "model": args.model,
        "quick": args.quick,
        "batch_size": B,
        "max_len": L,
        "mb_max_tokens": budget,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "attn_impl": args.attn_impl,
    }
    for r in results:
        s = r["setting"]
        summary[f"{s}_engine_tokens_per_s"] = round(r["engine_tokens_per_s"], 1)
        summary[f"{s}_plain_tokens_per_s"] = round(r["plain_tokens_per_s"], 1)
        summary[f"{s}_speedup"] = round(r["speedup"], 3)
        summary[f"{s}_goal"] = r["goal"]
        summary[f"{s}_goal_met"] = r["goal_met"]
        summary[f"{s}_engine_packing_efficiency"] = round(r["engine_packing_efficiency"], 3)
        summary[f"{s}_plain_packing_efficiency"] = round(r["plain_packing_efficiency"], 3)
        summary[f"{s}_first_step_loss_gap"] = r["first_step_loss_gap"]
    summary["verdict"] = "goals met" if all(r["goal_met"] for r in results) else "goals not met"
    print(json.dumps(summary))


def long_tailed_lengths(n: int, max_len: int, seed: int) -> list[int]:
    """RL answer lengths: ``max_len * u^3`` (u uniform), at least 8: many short, a few long."""
    u = torch.rand(n, generator=torch.Generator().manual_seed(seed))
    return [max(8, int(max_len * float(x) ** 3)) for x in u]


def packed_microbatches(lengths: list[int], budget: int, vocab: int, seed: int) -> list[dict]:
    """The engine's packing of ``lengths`` under ``budget``: model inputs of each micro-batch."""
    g = torch.Generator().manual_seed(seed)
    mbs = []
    for rows in split_into_microbatches(lengths, budget):
        lens = [lengths[i] for i in rows]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        mbs.append({"input_ids": torch.randint(5, vocab, (1, sum(lens)), generator=g),
                    "position_ids": torch.cat([torch.arange(n) for n in lens])[None],
                    "cu_seq_lens_q": cu, "use_cache": False})
    return mbs


ATTN_PASSES = ("train", "forward")


def attention_child(impl: str, model_dir: str, mb_spec: str) -> None:
    """``--attn-child``: one impl in its own process, timing a pass over the micro-batches each
    time the parent writes ``train`` or ``forward`` on stdin (answers the seconds on stdout).

    A process per impl: in one process the allocator state one impl leaves (flex's unfused CPU
    kernel allocates [heads, T, T] tensors) slows the next one's backward several-fold.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    n, max_len, budget = (int(x) for x in mb_spec.split(","))
    mbs = packed_microbatches(long_tailed_lengths(n, max_len, seed=7), budget,
                              AutoConfig.from_pretrained(model_dir).vocab_size, seed=1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation=register_attention(impl)).train()
    for line in sys.stdin:
        t0 = time.perf_counter()
        if line.strip() == "train":
            for mb in mbs:
                model(**mb).logits.mean().backward()
            model.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                for mb in mbs:
                    model(**mb)
        print(time.perf_counter() - t0, flush=True)


def time_attention(model_dir: Path, impls: list[str], mb_spec: str, rounds: int,
                   threads: int) -> dict[str, dict[str, list]]:
    """Seconds per pass (forward + backward, and forward alone) of each impl, per round; each impl
    in its own process (``attention_child``), one at a time, the order rotating every round."""
    import subprocess

    cmd = [sys.executable, __file__, "--threads", str(threads), "--attn-child"]
    procs = {i: subprocess.Popen([*cmd, i, str(model_dir), mb_spec], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for i in impls}
    times = {i: {kind: [] for kind in ATTN_PASSES} for i in impls}
    try:
        for r in range(rounds + 1):  # round 0 warms up and is not timed
            for impl in impls[r % len(impls):] + impls[:r % len(impls)]:
                for kind in ATTN_PASSES:
                    procs[impl].stdin.write(kind + "\n")
                    procs[impl].stdin.flush()
                    dt = float(procs[impl].stdout.readline())
                    if r > 0:
                        times[impl][kind].append(dt)
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait(timeout=60)
    return times


def attention_main(args) -> None:
    """``--attn``: each packed-attention impl that runs here against ``sdpa_loop``."""
    n, max_len, budget, rounds = (32, 512, 2048, 3) if args.quick else (64, 1024, 4096, 3)
    runnable, refused = [], {}
    for impl in ATTN_IMPLS[1:]:
        try:
            runnable.append(resolve_attn_impl(impl, "cpu", torch.float32))
        except ValueError as e:
            refused[impl] = str(e)
    runnable.sort(key=lambda i: i != "sdpa_loop")  # the baseline first
    lengths = long_tailed_lengths(n, max_len, seed=7)
    n_mbs = len(split_into_microbatches(lengths, budget))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", size=args.model, seed=0)
        times = time_attention(model_dir, runnable, f"{n},{max_len},{budget}", rounds, torch.get_num_threads())
    tokens = sum(lengths)
    summary = {"benchmark": "bench_train", "mode": "attn", "model": args.model, "quick": args.quick,
               "n_seqs": n, "max_len": max_len, "mb_max_tokens": budget, "n_mbs": n_mbs, "tokens": tokens,
               "median_len": int(statistics.median(lengths)), "rounds": rounds, "threads": torch.get_num_threads(),
               "device": "cpu", "attn_auto_resolves_to": resolve_attn_impl("auto", "cpu", torch.float32)}
    print(f"packed attention on CPU: model={args.model}, {n} seqs of long-tailed lengths (median "
          f"{summary['median_len']}, max {max(lengths)}), {n_mbs} micro-batches of <= {budget} tokens, "
          f"{rounds} timed rounds (medians), {torch.get_num_threads()} threads")
    print(f"{'impl':<10} {'train tok/s':>12} {'fwd tok/s':>10} {'train / sdpa_loop':>18} {'fwd / sdpa_loop':>16}")
    base = times["sdpa_loop"]
    for impl in runnable:
        t = times[impl]
        ratio = statistics.median(a / b for a, b in zip(t["train"], base["train"]))
        fwd_ratio = statistics.median(a / b for a, b in zip(t["forward"], base["forward"]))
        summary[f"attn_{impl}_train_tokens_per_s"] = round(tokens / statistics.median(t["train"]), 1)
        summary[f"attn_{impl}_forward_tokens_per_s"] = round(tokens / statistics.median(t["forward"]), 1)
        if impl != "sdpa_loop":
            summary[f"attn_{impl}_over_sdpa_loop"] = round(ratio, 3)
            summary[f"attn_{impl}_over_sdpa_loop_forward"] = round(fwd_ratio, 3)
        print(f"{impl:<10} {summary[f'attn_{impl}_train_tokens_per_s']:>12.0f} "
              f"{summary[f'attn_{impl}_forward_tokens_per_s']:>10.0f} {ratio:>18.2f} {fwd_ratio:>16.2f}")
    for impl, why in refused.items():
        print(f"{impl:<10} not run: {why}")
        summary[f"attn_{impl}_over_sdpa_loop"] = None
    print(json.dumps(summary))


if __name__ == "__main__":
    if "--lora" in sys.argv[1:]:  # LoRA vs full weights: benchmarks/bench_lora.py
        from benchmarks.bench_lora import main as lora_main

        sys.exit(lora_main([a for a in sys.argv[1:] if a != "--lora"] + ["--only", "memory"]))
    main()
