"""FP8 rollout against bf16: bytes pushed, push time, and the log-prob mismatch to the trainer.

- bytes: what one push of a Qwen2.5-1.5B-shaped model sends (from its shapes, no weights):
  FP8 blocks + float32 scales for the quantised layers and bf16 for the rest, against all
  bf16; also the quantised layers alone (where the 2x comes from: the 151936-token
  embedding stays bf16);
- push time: `WeightPublisher.publish` by the default method (distributed) of the demo's
  policy to two embedded servers, one ``--dtype bfloat16``, one ``--quantization fp8``,
  interleaved rounds, median and spread;
- mismatch: the mean |log-prob difference| and k3 KL of each server against the float32
  trainer (the HF forward, unrounded) on sequences the model itself samples.

    python benchmarks/bench_fp8.py [--model runs/demo/model] [--rounds 5]
    python benchmarks/bench_fp8.py --decode            # on a GPU (ci/gpu_local.sh)
    python benchmarks/bench_fp8.py --decode --dry-run  # the same code on a small CPU model

``--decode`` measures instead, on a randomly initialised Qwen2.5-1.5B-shaped model in bf16,
the decode tokens/s of the embedded server's linear layers in FP8 (`Fp8Linear`: FP8 tensor
cores where the card has them) against bf16 (a batch of sequences, KV cache, greedy), and the
trainer's side of a push: producing the FP8 buckets (quantising) against the bf16 ones.

The last line printed is one JSON object (``bytes_ratio`` is the whole push's bf16/FP8).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arealite.config.schema import WeightSyncConfig  # noqa: E402
from arealite.inference_client.sglang_client import SGLangClient  # noqa: E402
from arealite.quant.fp8 import BLOCK, stays_unquantised  # noqa: E402
from arealite.weight_sync import DistributedTransfer, Fp8Source, StateDictSource, WeightPublisher  # noqa: E402
from arealite.weight_sync.probe import mismatch  # noqa: E402
from benchmarks.push_server import start_server  # noqa: E402

#: Qwen2.5-1.5B's shapes (config.json of the released model).
QWEN_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
#: Larger members of the family (their released config.json): the embedding and the untied head,
#: which stay 16-bit, are a smaller share of the weights as the model grows.
QWEN_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)
QWEN_32B = dict(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False)


def push_bytes(shapes: dict[str, tuple[int, ...]]) -> tuple[int, int, int, int]:
    """(bf16 bytes, FP8 push bytes, bf16 bytes of the quantised layers, their FP8 bytes)."""
    bf16 = fp8 = lin_bf16 = lin_fp8 = 0
    for name, shape in shapes.items():
        n = 1
        for d in shape:
            n *= d
        bf16 += 2 * n
        if stays_unquantised(name, torch.empty(shape, device="meta")):
            fp8 += 2 * n
            continue
        q = n + 4 * -(-shape[0] // BLOCK) * -(-shape[1] // BLOCK)
        fp8, lin_bf16, lin_fp8 = fp8 + q, lin_bf16 + 2 * n, lin_fp8 + q
    return bf16, fp8, lin_bf16, lin_fp8


def qwen_shapes(config: dict = QWEN_1_5B) -> dict[str, tuple[int, ...]]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**config))
    # Meta tensors have no storage to tell tied ones apart: a tied LM head is left out by name.
    tied = config.get("tie_word_embeddings", False)
    return {n: tuple(t.shape) for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")}


_LOOP = asyncio.new_event_loop()
threading.Thread(target=_LOOP.run_forever, daemon=True).start()


def run(coro):
    """Run a client coroutine on the benchmark's event loop."""
    return asyncio.run_coroutine_threadsafe(coro, _LOOP).result(300)


def _publisher(addr: str, state: dict, fp8: bool) -> tuple[WeightPublisher, SGLangClient]:
    client = SGLangClient([addr])
    run(client.initialize(60))
    transfer = DistributedTransfer(WeightSyncConfig(bucket_size_mb=64), client.admin, run, wire_dtype=torch.bfloat16)
    source = StateDictSource(state)
    pub = WeightPublisher(transfer, Fp8Source(source) if fp8 else source, client.admin, run, parties=[client])
    pub.init()
    return pub, client


def _mismatch(model, client: SGLangClient, seqs: list[list[int]]) -> dict[str, float]:
    diffs, k3s = [], []
    for ids in seqs:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
        trainer = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
        ((server, _),) = run(client.admin.score_prompt(ids)).values()
        m = mismatch(server, trainer)
        diffs.append(m["probe_mean_abs_diff"])
        k3s.append(m["probe_k3"])
    return {"mean_abs_diff": statistics.mean(diffs), "kl_k3": statistics.mean(k3s)}


def _decode_tokens_per_s(model, batch: int, prompt: int, new: int, device: str) -> float:
    """Greedy decode of `batch` sequences (`new` tokens after a `prompt`-token prefill), tokens/s."""
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        sync()
        t0 = time.perf_counter()
        for _ in range(new):
            nxt = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
        sync()
    return batch * new / (time.perf_counter() - t0)


def _bucket_seconds(source, device: str) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for bucket in source.named_weight_buckets(256 << 20):
        for _, t in bucket:
            t.to(torch.bfloat16) if t.dtype == torch.float32 else t
    sync()
    return time.perf_counter() - t0


def decode_main(args) -> None:
    """FP8 vs bf16 decode tokens/s and push-side seconds (see the module's docstring)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from arealite.server.fp8_linear import quantize_linears

    device = "cpu" if args.dry_run else "cuda"
    shape = dict(QWEN_1_5B, num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=2,
                 vocab_size=1024) if args.dry_run else QWEN_1_5B
    batch, prompt, new = (2, 8, 4) if args.dry_run else (args.batch, 128, args.new_tokens)
    torch.manual_seed(0)
    with torch.device(device):
        bf16 = Qwen2ForCausalLM(Qwen2Config(**shape)).to(torch.bfloat16).eval()
        fp8 = Qwen2ForCausalLM(Qwen2Config(**shape)).to(torch.bfloat16).eval()
    fp8.load_state_dict(bf16.state_dict())
    n_fp8 = len(quantize_linears(fp8))
    out: dict[str, float] = {"fp8_layers": n_fp8}
    rounds = 1 if args.dry_run else args.rounds
    tps: dict[str, list[float]] = {"bf16": [], "fp8": []}
    push: dict[str, list[float]] = {"bf16": [], "fp8": []}
    source = StateDictSource(bf16)
    for _ in range(rounds):  # interleaved
        tps["bf16"].append(_decode_tokens_per_s(bf16, batch, prompt, new, device))
        tps["fp8"].append(_decode_tokens_per_s(fp8, batch, prompt, new, device))
        push["bf16"].append(_bucket_seconds(source, device))
        push["fp8"].append(_bucket_seconds(Fp8Source(source), device))
    for kind in ("bf16", "fp8"):
        out[f"decode_tok_s_{kind}"] = statistics.median(tps[kind])
        out[f"decode_tok_s_{kind}_spread"] = max(tps[kind]) - min(tps[kind])
        out[f"push_buckets_s_{kind}"] = statistics.median(push[kind])
    out["decode_speedup"] = out["decode_tok_s_fp8"] / out["decode_tok_s_bf16"]
    out["push_buckets_ratio"] = out["push_buckets_s_fp8"] / out["push_buckets_s_bf16"]
    print(f"decode (batch {batch}, {new} tokens, {rounds} rounds): bf16 {out['decode_tok_s_bf16']:.1f} tok/s, "
          f"FP8 {out['decode_tok_s_fp8']:.1f} tok/s ({out['decode_speedup']:.2f}x); producing the push's buckets: "
          f"bf16 {out['push_buckets_s_bf16']:.3f}s, FP8 {out['push_buckets_s_fp8']:.3f}s")
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="the policy (default: a fresh tiny 'small' model)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--decode", action="store_true", help="FP8 vs bf16 decode tokens/s on a 1.5B shape (GPU)")
    p.add_argument("--dry-run", action="store_true", help="with --decode: a small model on the CPU")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    args = p.parse_args()
    if args.decode:
        return decode_main(args)
    bf16, fp8, lin_bf16, lin_fp8 = push_bytes(qwen_shapes())
    out = {"bytes_ratio": bf16 / fp8, "bytes_ratio_quantised_layers": lin_bf16 / lin_fp8,
           "bytes_bf16_gb": bf16 / 1e9, "bytes_fp8_gb": fp8 / 1e9}
    print(f"Qwen2.5-1.5B push: bf16 {bf16 / 1e9:.2f} GB, FP8 {fp8 / 1e9:.2f} GB ({out['bytes_ratio']:.2f}x fewer; "
          f"quantised layers alone {out['bytes_ratio_quantised_layers']:.2f}x)")
    for label, config in (("7b", QWEN_7B), ("32b", QWEN_32B)):
        b, f, _, _ = push_bytes(qwen_shapes(config))
        out[f"bytes_ratio_{label}"] = b / f
        print(f"Qwen2.5-{label.upper()} push: bf16 {b / 1e9:.2f} GB, FP8 {f / 1e9:.2f} GB ({b / f:.2f}x fewer)")

    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else None
        if model_dir is None:
            from arealite.models.tiny import build_tiny_model

            model_dir = build_tiny_model(Path(tmp) / "model", size="small", seed=0)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        state = {n: t for n, t in StateDictSource(model).tensors}
        servers = {kind: start_server(model_dir, Path(tmp) / f"{kind}.log", extra)
                   for kind, extra in (("bf16", ["--dtype", "bfloat16"]),
                                       ("fp8", ["--dtype", "bfloat16", "--quantization", "fp8"]))}
        try:
            pubs = {kind: _publisher(addr, state, kind == "fp8") for kind, (_, addr) in servers.items()}
            times: dict[str, list[float]] = {"bf16": [], "fp8": []}
            for r in range(args.rounds):  # interleaved
                for kind, (pub, _) in pubs.items():
                    times[kind].append(pub.publish(r + 1)["total_s"])
            g = torch.Generator().manual_seed(0)
            seqs = [torch.randint(0, model.config.vocab_size, (48,), generator=g).tolist()
                    for _ in range(args.sequences)]
            for kind, (pub, client) in pubs.items():
                med = statistics.median(times[kind])
                out[f"push_s_{kind}"] = med
                out[f"push_s_{kind}_spread"] = max(times[kind]) - min(times[kind])
                for k, v in _mismatch(model, client, seqs).items():
                    out[f"{k}_{kind}"] = v
                pub.close()
        finally:
            for proc, _ in servers.values():
                proc.kill()
    out["push_time_ratio"] = out["push_s_fp8"] / out["push_s_bf16"]
    print(f"{'server':<6} {'push s (median)':>16} {'spread':>8} {'mean |dlogp|':>13} {'KL k3':>10}")
    for kind in ("bf16", "fp8"):
        print(f"{kind:<6} {out[f'push_s_{kind}']:>16.4f} {out[f'push_s_{kind}_spread']:>8.4f} "
              f"{out[f'mean_abs_diff_{kind}']:>13.5f} {out[f'kl_k3_{kind}']:>10.2e}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
