"""Training MFU on one GPU: the train engine against transformers' own padded SDPA path.

A randomly initialised model of Qwen2.5-1.5B's shape (config only, nothing downloaded: 28 layers,
hidden 1536, 12 query heads sharing 2 KV heads, MLP 8960, vocabulary 151,936, tied embeddings),
bfloat16 compute with float32 master weights and AdamW, trains on RL batches of long-tailed
lengths (``max_len * u^3`` with u uniform, at least 256 tokens: many short answers, a few long),
one optimizer step per batch, the token-mean log-likelihood as the loss (what a policy-gradient
loss costs: log-probs of the taken tokens over the whole vocabulary, with gradient):

- engine: `FSDPEngine` (a world of one), ``actor.attn_impl`` (default ``auto``: FlashAttention's
  varlen kernel) on micro-batches packed under ``--mb-tokens``, the fused chunked log-prob head;
- padded: the same model loaded by transformers with ``attn_implementation="sdpa"``, the rows
  sorted by length and cut into micro-batches, each padded to its own longest row, under the same
  token budget (padded tokens count), ``torch.autocast`` bfloat16, ``[B, L, V]`` logits in
  float32, log-softmax, backward, clip, fused AdamW step: the loop one writes with transformers
  alone. A side that runs out of memory is reported as such.

MFU = model FLOPs per step / step time / the card's dense bfloat16 peak. Model FLOPs count real
tokens only: ``6 x (matmul parameters, lm_head included) x tokens`` plus causal attention,
``6 x layers x hidden x sum(n_i^2)`` (forward ``2 n^2 h`` per layer for QK^T and AV under the
causal mask, backward twice that). Rounds alternate the two sides; the first round of each warms
up. Figures are medians over the timed rounds.

    python benchmarks/bench_mfu.py [--steps 4] [--batch 64] [--max-len 8192] [--mb-tokens 16384]
                                   [--attn-impl auto] [--layers N] [--checkpointing]

Needs CUDA (exits with a message otherwise). The last line is one JSON object with ``mfu``,
``tokens_per_s``, ``padded_tokens_per_s``, ``speedup`` (engine / padded tokens/s; goal >= 2) and
the card's name; goal: MFU >= 0.45 on an H100/H200. Run by ``ci/gpu_local.sh``.
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arealite.config.schema import ActorConfig  # noqa: E402
from arealite.train_engine.fsdp import FSDPEngine  # noqa: E402

#: Qwen2.5-1.5B's shape (its published config.json), for a randomly initialised model.
QWEN25_15B = dict(
    model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu", use_sliding_window=False,
)

#: Dense bfloat16 tensor-core peak (FLOP/s, no sparsity) by a substring of the card's name.
PEAK_BF16 = {"H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}


def peak_flops(name: str) -> float | None:
    """The card's dense bfloat16 peak, or None for a card this table does not know."""
    for key, value in PEAK_BF16.items():
        if key in name:
            return value
    return None


def write_config(out: Path, layers: int | None) -> Path:
    """A model directory holding only config.json (the engine's builder initialises the weights)."""
    from transformers import Qwen2Config

    shape = {k: v for k, v in QWEN25_15B.items() if k != "model_type"}
    if layers:
        shape["num_hidden_layers"] = layers
    Qwen2Config(**shape).save_pretrained(out)
    return out


def random_model(path, hf_config, attn_implementation=None) -> torch.nn.Module:
    """The engine's model builder here: the architecture from its config, random weights, float32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # initialise where it will train
        return AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn_implementation,
                                                dtype=torch.float32)


class RandomInitEngine(FSDPEngine):
    build_model = staticmethod(random_model)


def lengths_of(n: int, max_len: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g)
    return [max(256, int(max_len * float(x) ** 3)) for x in u]


def batch_of(lengths: list[int], vocab: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.randint(10, vocab, (len(lengths), L), generator=g)
    mask = torch.arange(L)[None] < torch.tensor(lengths)[:, None]
    return {"input_ids": ids * mask, "attention_mask": mask, "loss_mask": mask}


def model_flops(hf, lengths: list[int]) -> float:
    """Training FLOPs of one step on sequences of ``lengths`` (see the module's docstring)."""
    h, layers, kv = hf.hidden_size, hf.num_hidden_layers, hf.num_key_value_heads
    head_dim = h // hf.num_attention_heads
    per_layer = h * h * 2 + 2 * h * kv * head_dim + 3 * h * hf.intermediate_size  # q, o; k, v; gate, up, down
    matmul_params = layers * per_layer + hf.vocab_size * h  # the lm_head
    tokens = sum(lengths)
    return 6 * matmul_params * tokens + 6 * layers * h * sum(n * n for n in lengths)


def token_mean_nll(head, mb) -> torch.Tensor:
    logp = head.logprobs(mb["labels"])
    mask = mb["loss_mask"].float()
    return -(logp * mask).sum() / mask.sum().clamp(min=1)


def n_loss_tokens(mb) -> torch.Tensor:
    return mb["loss_mask"].sum()


def engine_side(model_dir: Path, args):
    cfg = ActorConfig(model_path=str(model_dir), dtype="bfloat16", mb_max_tokens=args.mb_tokens,
                      attn_impl=args.attn_impl, gradient_checkpointing=args.checkpointing)
    cfg.optimizer.lr = 1e-6
    cfg.optimizer.gradient_clipping = 1.0
    engine = RandomInitEngine(cfg, device="auto").initialize(total_steps=1000)

    def step(batch):
        engine.train_batch(batch, token_mean_nll, n_loss_tokens)

    return step, engine.hf_config, lambda: engine.destroy()


def padded_side(model_dir: Path, args):
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_dir)
    model = random_model(model_dir, hf, attn_implementation="sdpa").cuda().train()
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)

    def step(batch):
        n_tok = float(batch["loss_mask"][:, 1:].sum())
        opt.zero_grad(set_to_none=True)
        for rows in padded_microbatches(batch["attention_mask"].sum(1).tolist(), args.mb_tokens):
            width = int(batch["attention_mask"][rows].sum(1).max())
            ids = batch["input_ids"][rows, :width].cuda()
            am = batch["attention_mask"][rows, :width].cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=ids, attention_mask=am, use_cache=False).logits.float()
            logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
            loss = -(logp * am[:, 1:]).sum() / n_tok
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step, hf, lambda: None


def padded_microbatches(lengths: list[int], budget: int) -> list[list[int]]:
    """Rows longest first, cut so that rows x the longest row of each micro-batch <= ``budget``."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def timed(step, batches: list) -> list[float]:
    out = []
    for b in batches:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(b)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4, help="timed steps per side (after one warm-up step)")
    p.add_argument("--batch", type=int, default=64, help="sequences per step")
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--mb-tokens", type=int, default=16384, help="token budget of a micro-batch (both sides)")
    p.add_argument("--attn-impl", default="auto")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than 28 (a smaller card)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing on both sides")
    p.add_argument("--skip-padded", action="store_true", help="time the engine alone")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_mfu: needs a CUDA device (none here); not measured")
        print(json.dumps({"measured": False, "reason": "no CUDA device"}))
        return
    name = torch.cuda.get_device_name()
    peak = peak_flops(name)
    tmp = Path(tempfile.mkdtemp(prefix="bench_mfu_"))
    model_dir = write_config(tmp / "model", args.layers)
    batches = [batch_of(lengths_of(args.batch, args.max_len, s), QWEN25_15B["vocab_size"], s)
               for s in range(args.steps + 1)]
    lengths = [b["attention_mask"].sum(1).tolist() for b in batches]
    results = {}
    for side, build in (("engine", engine_side), ("padded", padded_side)):
        if side == "padded" and args.skip_padded:
            continue
        try:
            step, hf, close = build(model_dir, args)
            times = timed(step, batches)[1:]
        except torch.cuda.OutOfMemoryError as e:
            print(f"{side}: out of memory ({str(e).splitlines()[0]})")
            results[side] = {"oom": True, "step_s": None, "tokens_per_s": None, "mfu": None,
                             "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "times": []}
            torch.cuda.empty_cache()
            continue
        flops = [model_flops(hf, ls) for ls in lengths[1:]]
        tokens = [sum(ls) for ls in lengths[1:]]
        results[side] = {
            "step_s": statistics.median(times),
            "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, times)),
            "mfu": statistics.median(f / s / peak for f, s in zip(flops, times)) if peak else None,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
            "times": times,
        }
        close()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    eng, pad = results["engine"], results.get("padded")
    print(f"{name}: {sum(map(sum, lengths[1:])) // args.steps} real tokens per step, batch {args.batch}, "
          f"lengths 256..{args.max_len} (long-tailed), micro-batch budget {args.mb_tokens}")
    print(f"{'side':8} {'step s':>8} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9}")
    for side, r in results.items():
        if r.get("oom"):
            print(f"{side:8} {'out of memory':>26} {r['peak_mem_gib']:9.1f}")
            continue
        mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "n/a"
        print(f"{side:8} {r['step_s']:8.2f} {r['tokens_per_s']:10.0f} {mfu:>6} {r['peak_mem_gib']:9.1f}")
    print(json.dumps({
        "measured": True, "device": name, "peak_bf16_flops": peak, "attn_impl": args.attn_impl,
        "mfu": eng["mfu"], "tokens_per_s": eng["tokens_per_s"],
        "padded_tokens_per_s": pad["tokens_per_s"] if pad else None,
        "padded_mfu": pad["mfu"] if pad else None,
        "speedup": eng["tokens_per_s"] / pad["tokens_per_s"] if pad and pad["tokens_per_s"] else None,
        "padded_oom": bool(pad and pad.get("oom")),
        "goals": {"mfu": 0.45, "speedup": 2.0}, "engine_times": eng["times"],
        "padded_times": pad["times"] if pad else None,
    }))


if __name__ == "__main__":
    main()
