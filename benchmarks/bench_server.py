"""Throughput of the embedded server vs a bare in-process KV-cache decode loop.

Both decode the same batch: ``--batch`` prompts of ``--prompt-len`` tokens, each
extended by ``--new-tokens`` tokens (ignore_eos), on the same tiny model with
the same number of torch threads.

- baseline: one Python loop over the HF model with ``past_key_values`` (one
  prefill forward, then one forward per token for the whole batch), sampling
  at T=1 with ``torch.multinomial``.
- server: ``python -m arealite.server`` as a child process, ``--batch``
  concurrent ``/generate`` requests over real HTTP (T=1, return_logprob).

Measurements alternate (baseline, server, baseline, ...) so that machine load
drifts affect both; the median of ``--repeats`` runs is reported.

    python benchmarks/bench_server.py [--size small|base] [--quick]

The last line printed is a JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab - 1, (batch, length), generator=g).tolist()


def baseline_tokens_per_s(model, prompts: list[list[int]], new_tokens: int) -> float:
    """Bare HF decode loop with a KV cache over the whole batch."""
    import torch
    from transformers import DynamicCache

    ids = torch.tensor(prompts)
    B, L = ids.shape
    mask = torch.ones_like(ids)
    t0 = time.perf_counter()
    with torch.inference_mode():
        cache = DynamicCache()
        pos = torch.arange(L)[None].expand(B, L)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1]
        cur = torch.full((B,), L)
        out = []
        for step in range(new_tokens):
            lp = torch.log_softmax(logits.float(), dim=-1)
            tok = torch.multinomial(lp.exp(), 1)[:, 0]
            out.append(tok.tolist())  # results leave the tensor world each step, as in a server
            if step == new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype)], dim=1)
            logits = model(input_ids=tok[:, None], attention_mask=mask, position_ids=cur[:, None],
                           past_key_values=cache, use_cache=True).logits[:, -1]
            cur = cur + 1
    dt = time.perf_counter() - t0
    return B * new_tokens / dt


async def server_tokens_per_s(url: str, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """``len(prompts)`` concurrent /generate requests; returns (tokens/s, mean latency)."""
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async def one(p):
            t = time.perf_counter()
            async with http.post(url + "/generate", json={
                "input_ids": p, "return_logprob": True,
                "sampling_params": {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True},
            }) as r:
                body = await r.json()
                assert r.status == 200, body
                assert len(body["output_ids"]) == new_tokens
            return time.perf_counter() - t

        t0 = time.perf_counter()
        lat = await asyncio.gather(*(one(p) for p in prompts))
        dt = time.perf_counter() - t0
    return len(prompts) * new_tokens / dt, statistics.mean(lat)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small", choices=("micro", "small", "base", "large"))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads, for both sides")
    p.add_argument("--quick", action="store_true", help="short run: 2 repeats, 32 new tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.new_tokens = 2, 32

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from arealite.models.tiny import build_tiny_model, n_parameters
    from arealite.server.process import ServerProcess

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench_server_"))
    model_dir = build_tiny_model(tmp / args.size, size=args.size, seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = make_prompts(args.batch, args.prompt_len, model.config.vocab_size)

    server = ServerProcess(model_dir, free_port(), threads=args.threads, log_path=tmp / "server.log",
                           extra_args=["--max-batch-size", str(max(args.batch, 1))])
    try:
        server.wait_healthy(timeout=300)
        # Warm-up both sides (first forwards allocate and pick kernels).
        baseline_tokens_per_s(model, prompts, 4)
        asyncio.run(server_tokens_per_s(server.url, prompts, 4))
        base, serv, lat = [], [], []
        for _ in range(args.repeats):
            base.append(baseline_tokens_per_s(model, prompts, args.new_tokens))
            s, l = asyncio.run(server_tokens_per_s(server.url, prompts, args.new_tokens))
            serv.append(s)
            lat.append(l)
    finally:
        server.stop()

    b, s = statistics.median(base), statistics.median(serv)
    ratio = s / b
    rows = [
        ("model", f"{args.size} ({n_parameters(model_dir) / 1e6:.2f}M params)"),
        ("batch x new tokens", f"{args.batch} x {args.new_tokens} (prompt {args.prompt_len})"),
        ("torch threads", str(args.threads)),
        ("baseline (bare HF KV-cache loop)", f"{b:9.1f} tok/s"),
        ("embedded server (HTTP, concurrent)", f"{s:9.1f} tok/s"),
        ("server / baseline", f"{ratio:9.3f}   (goal >= 0.8)"),
        ("server mean request latency", f"{statistics.mean(lat) * 1000:9.1f} ms"),
    ]
    w = max(len(k) for k, _ in rows)
    print("\nembedded server throughput")
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")
    print(json.dumps({
        "benchmark": "bench_server", "size": args.size, "batch": args.batch, "new_tokens": args.new_tokens,
        "prompt_len": args.prompt_len, "threads": args.threads, "repeats": args.repeats,
        "baseline_tok_s": round(b, 1), "server_tok_s": round(s, 1), "ratio": round(ratio, 4),
        "baseline_runs": [round(x, 1) for x in base], "server_runs": [round(x, 1) for x in serv],
        "server_mean_latency_ms": round(statistics.mean(lat) * 1000, 2),
    }))


if __name__ == "__main__":
    main()
