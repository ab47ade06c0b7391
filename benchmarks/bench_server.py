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
drifts affect both. Other processes only ever slow a run down, so the best of
``--repeats`` runs is the headline figure (the median is reported too).

    python benchmarks/bench_server.py [--size small|base] [--quick]

The last line printed is a JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
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


def baseline_tokens_per_s(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """Bare HF decode loop with a KV cache over the whole batch; (tokens per wall s, per CPU s)."""
    import torch
    from transformers import DynamicCache

    ids = torch.tensor(prompts)
    B, L = ids.shape
    mask = torch.ones_like(ids)
    t0, c0 = time.perf_counter(), time.process_time()
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
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return B * new_tokens / dt, B * new_tokens / cpu


async def server_cpu_s(http, url: str) -> float:
    async with http.get(url + "/get_server_info") as r:
        return (await r.json())["internal_states"][0]["cpu_time_s"]


async def server_tokens_per_s(http, url: str, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, float]:
    """``len(prompts)`` concurrent /generate requests: (tokens per wall s, per server CPU s, mean latency).

    ``http`` is a long-lived aiohttp session, so connections are reused as a
    real client's are.
    """
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

    c0 = await server_cpu_s(http, url)
    t0 = time.perf_counter()
    lat = await asyncio.gather(*(one(p) for p in prompts))
    dt = time.perf_counter() - t0
    cpu = await server_cpu_s(http, url) - c0
    n = len(prompts) * new_tokens
    return n / dt, n / cpu, statistics.mean(lat)


async def measure(model, url: str, prompts, new_tokens: int, repeats: int) -> dict[str, list[float]]:
    """Alternate baseline and server runs; every figure per run."""
    import aiohttp

    runs: dict[str, list[float]] = {"base": [], "base_cpu": [], "serv": [], "serv_cpu": [], "lat": []}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=len(prompts) + 4)) as http:
        # Warm-up both sides (first forwards allocate; connections open).
        baseline_tokens_per_s(model, prompts, 4)
        await server_tokens_per_s(http, url, prompts, 4)
        for _ in range(repeats):
            b, bc = baseline_tokens_per_s(model, prompts, new_tokens)
            s, sc, lat = await server_tokens_per_s(http, url, prompts, new_tokens)
            for k, v in zip(runs, (b, bc, s, sc, lat)):
                runs[k].append(v)
    return runs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small", choices=("micro", "small", "base", "large"))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
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
    n_params = n_parameters(model_dir)

    server = ServerProcess(model_dir, free_port(), threads=args.threads, log_path=tmp / "server.log",
                           extra_args=["--max-batch-size", str(max(args.batch, 1))])
    try:
        server.wait_healthy(timeout=300)
        runs = asyncio.run(measure(model, server.url, prompts, args.new_tokens, args.repeats))
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    med = statistics.median
    base, serv = runs["base"], runs["serv"]
    ratio_best = max(serv) / max(base)
    ratio_median = med(serv) / med(base)
    ratio_cpu = med(runs["serv_cpu"]) / med(runs["base_cpu"])
    rows = [
        ("model", f"{args.size} ({n_params / 1e6:.2f}M params)"),
        ("batch x new tokens", f"{args.batch} x {args.new_tokens} (prompt {args.prompt_len})"),
        ("torch threads / repeats", f"{args.threads} / {args.repeats}"),
        ("", "   wall best   wall median   per CPU-second (median)"),
        ("baseline (bare HF KV-cache loop)", f"{max(base):10.1f} {med(base):12.1f} {med(runs['base_cpu']):14.1f}  tok/s"),
        ("embedded server (HTTP, concurrent)", f"{max(serv):10.1f} {med(serv):12.1f} {med(runs['serv_cpu']):14.1f}  tok/s"),
        ("server / baseline (goal >= 0.8)", f"{ratio_best:10.3f} {ratio_median:12.3f} {ratio_cpu:14.3f}"),
        ("server mean request latency", f"{statistics.mean(runs['lat']) * 1000:10.1f} ms"),
    ]
    w = max(len(k) for k, _ in rows)
    print("\nembedded server throughput (wall figures are noisy on a shared machine; "
          "the CPU-second figures count work done)")
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")
    print(json.dumps({
        "benchmark": "bench_server", "size": args.size, "batch": args.batch, "new_tokens": args.new_tokens,
        "prompt_len": args.prompt_len, "threads": args.threads, "repeats": args.repeats,
        "baseline_tok_s": round(med(base), 1), "server_tok_s": round(med(serv), 1),
        "ratio": round(ratio_median, 4), "ratio_best": round(ratio_best, 4), "ratio_cpu": round(ratio_cpu, 4),
        "baseline_tok_per_cpu_s": round(med(runs["base_cpu"]), 1),
        "server_tok_per_cpu_s": round(med(runs["serv_cpu"]), 1),
        "baseline_runs": [round(x, 1) for x in base], "server_runs": [round(x, 1) for x in serv],
        "server_mean_latency_ms": round(statistics.mean(runs["lat"]) * 1000, 2),
    }))


if __name__ == "__main__":
    main()
