"""LoRA (rank 16 on every linear module) against full fine-tuning, on the same tiny model.

Two figures, both measured on the real engines in one run:

- **push**: one `WeightPublisher.publish` end to end to an embedded server (pause, transfer,
  version, continue): the LoRA run's `LoraTransfer` (the adapter as a PEFT directory,
  unloaded and reloaded under one name) vs full weights by disk (`DiskTransfer`, the same
  route kind: a directory loaded by path), by same-host shared memory (`ShmTransfer`, the
  fastest full-weight path) and by a process group (`DistributedTransfer`, the default
  `weight_sync.method`). Bytes pushed and seconds with each phase, best of ``--rounds``,
  repeated ``--repeats`` times (median and spread).
- **trainer memory**: parameters + gradients + optimizer state of `LoraFSDPEngine` vs
  `FSDPEngine` after one PPO-style training step, summed from the tensors themselves
  (parameter storage, each gradient as it is accumulated, AdamW's state tensors).

    python benchmarks/bench_lora.py              # "large" tiny model (~50M), 3 repeats
    python benchmarks/bench_lora.py --quick      # "base" model, 1 repeat
    python benchmarks/bench_weight_sync.py --lora    # the push figures only (--only push)
    python benchmarks/bench_train.py --lora          # the memory figures only (--only memory)

Goals (issue: LoRA): >= 20x fewer bytes and >= 5x faster push, >= 3x less trainer memory.
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arealite.algo.sft import build_sft_batch, sft_loss_fn, sft_loss_weight  # noqa: E402
from arealite.config.schema import ActorConfig, LoraConfig, OptimizerConfig, WeightSyncConfig  # noqa: E402
from arealite.train_engine.fsdp import FSDPEngine  # noqa: E402
from arealite.inference_client.sglang_client import SGLangClient  # noqa: E402
from arealite.lora.engine import LoraFSDPEngine  # noqa: E402
from arealite.weight_sync import DiskTransfer, DistributedTransfer, ShmTransfer, WeightPublisher  # noqa: E402
from arealite.weight_sync.lora_push import AdapterSource, LoraTransfer  # noqa: E402
from benchmarks.push_server import start_server  # noqa: E402

RANK = 16


def actor_config(model_dir: Path, lora: bool) -> ActorConfig:
    return ActorConfig(model_path=str(model_dir), mb_max_tokens=4096,
                       lora=LoraConfig(rank=RANK, alpha=2.0 * RANK) if lora else None,
                       optimizer=OptimizerConfig(lr=1e-4, warmup_steps=0, lr_scheduler="constant"))


def _bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # FSDP2 parameters are DTensors
    return local.numel() * local.element_size()


def trainer_memory(engine: FSDPEngine, model_dir: Path) -> dict[str, int]:
    """Bytes of parameters, gradients (peak, recorded as they are accumulated) and optimizer
    state after one training step."""
    from transformers import AutoTokenizer

    grads: dict[int, int] = {}
    hooks = [p.register_post_accumulate_grad_hook(lambda p: grads.__setitem__(id(p), _bytes(p.grad)))
             for p in engine.model.parameters() if p.requires_grad]
    tok = AutoTokenizer.from_pretrained(model_dir)
    batch = build_sft_batch(tok, [f"reverse {i}{i + 7}{i + 3} =" for i in range(16)], [" 123"] * 16)
    engine.train_batch(batch, sft_loss_fn, sft_loss_weight)
    for h in hooks:
        h.remove()
    optim = sum(_bytes(v) for state in engine.optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    params = sum(_bytes(p) for p in engine.model.parameters())
    trainable = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
    return {"params": params, "grads": sum(grads.values()), "optim": optim, "trainable": trainable,
            "total": params + sum(grads.values()) + optim}


def push_times(model_dir: Path, lora_engine: LoraFSDPEngine, full_engine: FSDPEngine, rounds: int,
               work: Path) -> dict[str, tuple[float, float]]:
    """(best seconds, bytes) of one publish per path."""
    work.mkdir(parents=True, exist_ok=True)
    proc, addr = start_server(model_dir, work / "server.log")
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    client = SGLangClient([addr], lora_adapter="policy")  # as a LoRA run's clients are built
    cfg = WeightSyncConfig(bucket_size_mb=64.0, timeout_s=300)
    out: dict[str, tuple[float, float]] = {}
    try:
        run(client.initialize(60))
        admin = client.admin
        paths = (
            ("lora", LoraTransfer(cfg, admin, run, work / "lora", lora_engine.adapter_config(), name="policy"),
             AdapterSource(lora_engine)),
            ("full_disk", DiskTransfer(cfg, admin, run, work / "disk", str(model_dir)), full_engine),
            ("full_shm", ShmTransfer(cfg, admin, run), full_engine),
            ("full_dist", DistributedTransfer(cfg, admin, run), full_engine),  # the default method
        )
        version = 0
        for name, transfer, source in paths:
            pub = WeightPublisher(transfer, source, admin, run, parties=[client])
            pub.init()
            pub.publish(version := version + 1)  # warm-up
            best, n_bytes, phases = float("inf"), 0.0, {}
            for _ in range(rounds):
                t0 = time.perf_counter()
                timings = pub.publish(version := version + 1)
                took = time.perf_counter() - t0
                if took < best:
                    best, phases = took, {k: v for k, v in timings.items() if k.endswith("_s")}
                n_bytes = timings.get("bytes", n_bytes)
            print(f"  {name}: best {best:.4f}s; phases: " + ", ".join(f"{k} {v:.4f}" for k, v in phases.items()))
            if name != "lora":
                n_bytes = float(sum(_bytes(t) for bucket in source.named_weight_buckets(1 << 30) for _, t in bucket))
            out[name] = (best, n_bytes)
            pub.close()
            if name == "lora":  # the full-weight pushes serve the base model
                client.wire.lora_path = admin.lora_path = None
    finally:
        run(client.aclose())
        proc.terminate()
        proc.wait(30)
    return out


def _stats(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="base model, one repeat")
    ap.add_argument("--size", choices=["micro", "small", "base", "large"], default=None)
    ap.add_argument("--repeats", type=int, default=None, help="independent measurements (median, spread)")
    ap.add_argument("--rounds", type=int, default=3, help="publishes per measurement (best of)")
    ap.add_argument("--only", choices=["push", "memory"], default=None, help="one of the two figures")
    args = ap.parse_args(argv)
    size = args.size or ("base" if args.quick else "large")
    repeats = args.repeats or (1 if args.quick else 3)
    from arealite.models.tiny import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    model_dir = build_tiny_model(work / "model", size=size, seed=0)
    full = FSDPEngine(actor_config(model_dir, lora=False)).initialize(total_steps=10)
    lora = LoraFSDPEngine(actor_config(model_dir, lora=True)).initialize(total_steps=10)
    out: dict = {"bench": "lora", "model_size": size, "rank": RANK}
    print(f"\nLoRA rank {RANK} (all linear modules) vs full weights, '{size}' tiny model")
    if args.only != "memory":
        runs = [push_times(model_dir, lora, full, args.rounds, work / f"r{i}") for i in range(repeats)]
        out.update(report_push(runs, args.rounds))
    if args.only != "push":
        out.update(report_memory({"full": trainer_memory(full, model_dir), "lora": trainer_memory(lora, model_dir)}))
    full.destroy()
    lora.destroy()
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))


def report_push(runs: list[dict[str, tuple[float, float]]], rounds: int) -> dict:
    """Print the push table; the figures for the JSON line."""
    secs = {k: _stats([r[k][0] for r in runs]) for k in runs[0]}
    nbytes = {k: runs[0][k][1] for k in runs[0]}
    speed = {k: _stats([r[k][0] / r["lora"][0] for r in runs]) for k in runs[0] if k != "lora"}
    byte_ratio = nbytes["full_disk"] / nbytes["lora"]
    print(f"push: {len(runs)} repeat(s) x best of {rounds}")
    print(f"{'push':<11}{'MB':>10}{'seconds (median, min-max)':>30}{'full/LoRA time':>18}")
    for k, (med, lo, hi) in secs.items():
        ratio = f"{speed[k][0]:.1f}x ({speed[k][1]:.1f}-{speed[k][2]:.1f})" if k in speed else "1.0x"
        print(f"{k:<11}{nbytes[k] / 2**20:>10.2f}{f'{med:.3f} ({lo:.3f}-{hi:.3f})':>30}{ratio:>18}")
    print(f"bytes pushed: {byte_ratio:.0f}x fewer (goal >= 20x); push (goal >= 5x faster): "
          + ", ".join(f"{speed[k][0]:.1f}x faster than full weights by {k.removeprefix('full_')}" for k in speed))
    return {
        "repeats": len(runs), "rounds": rounds,
        **{f"{k}_bytes": int(v) for k, v in nbytes.items()},
        **{f"{k}_s_median": round(v[0], 4) for k, v in secs.items()},
        **{f"{k}_over_lora_median": round(v[0], 2) for k, v in speed.items()},
        **{f"{k}_over_lora_min": round(v[1], 2) for k, v in speed.items()},
        **{f"{k}_over_lora_max": round(v[2], 2) for k, v in speed.items()},
        "bytes_ratio": round(byte_ratio, 1), "goal_bytes_ratio": 20, "goal_push_ratio": 5,
    }


def report_memory(mem: dict[str, dict[str, int]]) -> dict:
    """Print the trainer-memory table; the figures for the JSON line."""
    ratio = mem["full"]["total"] / mem["lora"]["total"]
    print(f"{'memory MB':<11}{'params':>10}{'grads':>10}{'optim':>10}{'total':>10}{'trainable':>12}")
    for k, m in mem.items():
        print(f"{k:<11}" + "".join(f"{m[f] / 2**20:>10.1f}" for f in ("params", "grads", "optim", "total"))
              + f"{m['trainable']:>12,}")
    print(f"trainer memory (parameters + gradients + optimizer state): {ratio:.1f}x smaller (goal >= 3x)")
    return {"memory_full_bytes": mem["full"]["total"], "memory_lora_bytes": mem["lora"]["total"],
            "memory_ratio": round(ratio, 2), "goal_memory_ratio": 3}


if __name__ == "__main__":
    main()
