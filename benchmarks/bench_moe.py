"""Routing replay (R3) on a tiny MoE, on CPU: how far the trainer's policy is from the server's.

An embedded server serves the tiny Qwen3-MoE in bfloat16 (``--enable-return-routed-experts``)
and samples completions through the real client; the trainer side runs the same weights in
float32, so the two networks disagree as GPU kernels and precisions do. For every generated
token it compares, without and with R3 (`arealite.moe.router_hooks`):

- routing mismatch: share of (token, MoE layer) whose top-k set differs from the server's;
- mean |log-prob difference| between behaviour (server) and trainer log-probs;
- KL(behaviour || trainer), k3 estimate on the sampled tokens.

    python benchmarks/bench_moe.py [--size moe-small | --model DIR] [--prompts 16] [--new-tokens 32]

Prints a table and one JSON line with ``routing_mismatch_r3`` (goal 0) and
``logprob_mismatch_ratio`` (without / with R3; goal >= 5).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import tempfile
from pathlib import Path

import torch

from arealite.api.types import GenerationRequest, SamplingParams
from arealite.inference_client.sglang_client import SGLangClient
from arealite.models.tiny import build_tiny_model
from arealite.server.process import ServerProcess
from arealite.moe.router_hooks import RoutingCapture, RoutingReplay


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _sample(url: str, prompts: list[list[int]], new_tokens: int):
    async with SGLangClient([url]) as client:
        client.wire.return_routed_experts = True
        sp = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
        return await asyncio.gather(*[client.agenerate(GenerationRequest(p, sp)) for p in prompts])


def _trainer_pass(model, comp, top_k: int, replay: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of the output tokens, experts used ``[n-1, layers, k]``) of one fp32 forward."""
    ids = torch.tensor([comp.input_ids + comp.output_ids[:-1]])
    server = comp.routed_experts.view(ids.shape[1], -1, top_k)
    with torch.no_grad():
        if replay:
            with RoutingReplay(model, server), RoutingCapture(model) as cap:  # capture sees the replayed
                logits = model(input_ids=ids).logits[0]
        else:
            with RoutingCapture(model) as cap:
                logits = model(input_ids=ids).logits[0]
        used = cap.take()
    n_prompt = len(comp.input_ids)
    lp = logits[n_prompt - 1:].float().log_softmax(-1)
    out = torch.tensor(comp.output_ids)
    return lp.gather(-1, out[:, None]).squeeze(-1), used


def _flipped(model, comps, top_k: int) -> list[torch.Tensor]:
    """Per completion, which output tokens the trainer's own routing scores with other experts
    than the server's at some layer (the tokens routing replay is for)."""
    out = []
    for c in comps:
        _, used = _trainer_pass(model, c, top_k, replay=False)
        server = c.routed_experts.view(used.shape[0], -1, top_k)
        differs = (used.sort(-1).values != server.sort(-1).values).any(-1).any(-1)  # [rows]
        out.append(differs[len(c.input_ids) - 1:])  # row n_prompt - 1 + j scores output token j
    return out


def _measure(model, comps, top_k: int, replay: bool, flipped: list[torch.Tensor]) -> dict[str, float]:
    diffs, kls, mism, on_flipped = [], [], [], []
    for c, f in zip(comps, flipped):
        lp, used = _trainer_pass(model, c, top_k, replay)
        server = c.routed_experts.view(used.shape[0], -1, top_k)
        same = (used.sort(-1).values == server.sort(-1).values).all(-1)  # [tokens, layers]
        mism.append((~same).float().flatten())
        r = lp - torch.tensor(c.output_logprobs)
        diffs.append(r.abs())
        kls.append(r.exp() - 1 - r)
        on_flipped.append(r.abs()[f])
    flipped_diffs = torch.cat(on_flipped)
    return {"routing_mismatch": float(torch.cat(mism).mean()),
            "logprob_abs_diff": float(torch.cat(diffs).mean()),
            "logprob_abs_diff_flipped": float(flipped_diffs.mean()) if flipped_diffs.numel() else float("nan"),
            "kl_k3": float(torch.cat(kls).mean())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="moe-small")
    ap.add_argument("--model", default=None, help="an MoE model directory to use instead of a fresh random one "
                    "(e.g. the MoE demo's warmed-up policy: runs/demo_moe/model)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--data", default=None, help="a JSONL file whose `prompt` fields are the prompts (with --model; "
                    "default: random token ids)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=INT",
                    help="override one of the size's dimensions (e.g. --set num_hidden_layers=12)")
    args = ap.parse_args()
    dims = {k: int(v) for k, v in (item.split("=", 1) for item in args.set)}
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else build_tiny_model(Path(tmp) / "moe", size=args.size,
                                                                         seed=args.seed, **dims)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        top_k = int(model.config.num_experts_per_tok)
        vocab = int(model.config.vocab_size)
        if args.data:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model_dir)
            lines = Path(args.data).read_text().splitlines()[: args.prompts]
            prompts = [tok.encode(json.loads(line)["prompt"]) for line in lines]
        else:
            prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(8, 24))] for _ in range(args.prompts)]
        proc = ServerProcess(model_dir, _free_port(), log_path=Path(tmp) / "server.log", threads=1,
                             extra_args=["--dtype", "bfloat16", "--enable-return-routed-experts",
                                         "--random-seed", str(args.seed)])
        try:
            url = proc.wait_healthy().url
            comps = asyncio.run(_sample(url, prompts, args.new_tokens))
        finally:
            proc.stop()
        flipped = _flipped(model, comps, top_k)
        plain = _measure(model, comps, top_k, replay=False, flipped=flipped)
        r3 = _measure(model, comps, top_k, replay=True, flipped=flipped)
    n_tokens = sum(len(c.output_ids) for c in comps)
    print(f"{args.model or 'tiny ' + args.size}: served bfloat16, trained float32; {len(comps)} samples, {n_tokens} generated tokens")
    n_flipped = int(sum(int(f.sum()) for f in flipped))
    print(f"{'':14}{'routing mismatch':>18}{'mean |dlogp|':>14}{'on flipped':>12}{'KL (k3)':>12}")
    for name, m in (("without R3", plain), ("with R3", r3)):
        print(f"{name:14}{m['routing_mismatch']:>18.4f}{m['logprob_abs_diff']:>14.5f}"
              f"{m['logprob_abs_diff_flipped']:>12.5f}{m['kl_k3']:>12.2e}")
    print(f"'on flipped': the {n_flipped} output tokens the trainer's own routing scores with other experts")
    ratio = plain["logprob_abs_diff"] / max(r3["logprob_abs_diff"], 1e-12)
    print(json.dumps({
        "bench": "moe", "size": args.size, "dims": dims, "model": args.model, "samples": len(comps), "tokens": n_tokens,
        "routing_mismatch": round(plain["routing_mismatch"], 5), "routing_mismatch_r3": round(r3["routing_mismatch"], 5),
        "logprob_abs_diff": plain["logprob_abs_diff"], "logprob_abs_diff_r3": r3["logprob_abs_diff"],
        "kl": plain["kl_k3"], "kl_r3": r3["kl_k3"], "logprob_mismatch_ratio": round(ratio, 2),
        "flipped_tokens": n_flipped, "logprob_abs_diff_flipped": plain["logprob_abs_diff_flipped"],
        "logprob_abs_diff_flipped_r3": r3["logprob_abs_diff_flipped"],
        "flipped_logprob_mismatch_ratio": round(plain["logprob_abs_diff_flipped"]
                                                / max(r3["logprob_abs_diff_flipped"], 1e-12), 2),
    }))


if __name__ == "__main__":
    main()
