"""The planner's trainer memory against the measured peak of live tensor bytes (issue 45).

For each configuration below (tiny models, float32 on the CPU, gloo ranks under ``torchrun``),
one process per rank builds the real `FSDPEngine` (or `LoraFSDPEngine`), runs one warm-up step
(AdamW's state allocated), then one measured step under ``torch.distributed._tools.mem_tracker.
MemTracker`` (a dispatch mode that counts every tensor storage alive, the model's parameters,
gradients and optimizer state included, and FSDP2's storage resizes). The figure of a run is
its largest rank's peak; the prediction is `arealite.plan.trainer_memory.trainer_rank_memory`
of the same config (``device="cpu"``) with the same rows' lengths.

    python benchmarks/bench_plan.py [--only NAME ...]

Prints a table, then as its last line one JSON object: ``max_abs_error_pct`` and
``errors_pct`` per configuration (goal: every one within 10%).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: name -> (model size, ranks, engine fields, rows x row length, lora)
CONFIGS: dict[str, dict] = {
    "micro-1": dict(size="micro", ranks=1, engine={}, rows=(4, 256)),
    "micro-ckpt": dict(size="micro", ranks=1, engine={"gradient_checkpointing": True}, rows=(4, 256)),
    "micro-dp2-2mb": dict(size="micro", ranks=2, engine={"mb_max_tokens": 512}, rows=(4, 256)),
    "small-sp2": dict(size="small", ranks=2, engine={"sp_size": 2}, rows=(2, 512)),
    "small-tp2": dict(size="small", ranks=2, engine={"tp_size": 2}, rows=(2, 512)),
    "moe-ep2": dict(size="moe-micro", ranks=2, engine={}, rows=(4, 256), ep=2),
    "small-sp2xtp2": dict(size="small", ranks=4, engine={"sp_size": 2, "tp_size": 2}, rows=(2, 512)),
    "micro-lora": dict(size="micro", ranks=1, engine={}, rows=(4, 256), lora=True),
    "small-long-ckpt": dict(size="small", ranks=1, engine={"gradient_checkpointing": True}, rows=(1, 2048)),
    "small-short": dict(size="small", ranks=2, engine={}, rows=(2, 32)),
}


def _config(model_dir: str, spec: dict):
    from arealite.config.schema import ArealiteConfig

    rows, length = spec["rows"]
    engine = {"model_path": model_dir, "mb_max_tokens": rows * length, **spec["engine"]}
    if spec.get("ep"):
        engine["ep_size"] = spec["ep"]
    if spec.get("lora"):
        engine["lora"] = {"rank": 8}
    return ArealiteConfig.model_validate({"actor": engine, "launch": {"n_trainer_procs": spec["ranks"]}})


def _nll(head, mb):
    logp = head.logprobs(mb["labels"])
    mask = mb["loss_mask"].float()
    return -(logp * mask).sum() / mask.sum().clamp(min=1)


def child(model_dir: str, name: str, out: str) -> None:
    """One rank: warm up, then measure one step's peak of live tensor bytes."""
    import torch
    import torch.distributed as dist
    from arealite.lora.engine import LoraFSDPEngine
    from arealite.plan.measured import step_peak
    from arealite.train_engine.fsdp import FSDPEngine

    spec = CONFIGS[name]
    cfg = _config(model_dir, spec)
    engine = (LoraFSDPEngine(cfg.actor, device="cpu") if spec.get("lora")
              else FSDPEngine(cfg.actor, device="cpu")).initialize(total_steps=10)
    rows, length = spec["rows"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, engine.hf_config.vocab_size - 1, (rows * engine.layout.dp, length), generator=g)
    mine = slice(engine.rank, None, engine.world_size)  # each rank hands its own rows
    mask = torch.ones_like(ids[mine], dtype=torch.bool)
    batch = {"input_ids": ids[mine], "attention_mask": mask, "loss_mask": mask}
    weight = lambda mb: mb["loss_mask"].sum()  # noqa: E731
    engine.train_batch(batch, _nll, weight)
    peak = step_peak(engine, batch, _nll, weight)
    Path(f"{out}.{engine.rank}").write_text(json.dumps(peak))
    if dist.is_initialized():
        dist.barrier()
    engine.destroy()


def measure(model_dir: Path, name: str, tmp: Path) -> dict:
    spec = CONFIGS[name]
    out = tmp / f"{name}-{time.monotonic_ns()}"
    args = [str(Path(__file__).resolve()), "--child", str(model_dir), name, str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if spec["ranks"] == 1:
        cmd = [sys.executable, *args]
    else:
        from arealite.utils.dist import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(spec["ranks"]),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(tmp.glob(out.name + ".*"))]
    return max(ranks, key=lambda r: r["peak"])


def predict(model_dir: Path, name: str):
    from arealite.plan.trainer_memory import trainer_rank_memory

    spec = CONFIGS[name]
    cfg = _config(str(model_dir), spec)
    rows, length = spec["rows"]
    mb_tokens = cfg.actor.mb_max_tokens
    per_mb = max(1, mb_tokens // length)
    n_mb = -(-rows // per_mb)
    return trainer_rank_memory(cfg, device="cpu", seq_lens=[length] * min(rows, per_mb), n_microbatches=n_mb)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", default=None, help="configuration names (default: all)")
    p.add_argument("--verbose", action="store_true", help="print each prediction's breakdown")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(*args.child)
        return
    from arealite.models.tiny import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench_plan_"))
    models: dict[str, Path] = {}
    errors: dict[str, float] = {}
    print(f"{'configuration':18} {'ranks':>5} {'predicted MiB':>14} {'measured MiB':>13} {'error %':>8}")
    for name in args.only or list(CONFIGS):
        size = CONFIGS[name]["size"]
        if size not in models:
            models[size] = build_tiny_model(tmp / size, size=size, seed=0)
        measured = measure(models[size], name, tmp)
        plan = predict(models[size], name)
        errors[name] = round(100 * (plan.total - measured["peak"]) / measured["peak"], 2)
        print(f"{name:18} {CONFIGS[name]['ranks']:5d} {plan.total / 2**20:14.2f} {measured['peak'] / 2**20:13.2f} "
              f"{errors[name]:8.1f}", flush=True)
        if args.verbose:
            print("\n".join(f"    {k:32} {v / 2**20:9.3f} MiB" for k, v in plan.parts.items()))
            print("   ", plan.notes[0], "\n    measured:", measured)
    print(json.dumps({"max_abs_error_pct": max(abs(e) for e in errors.values()), "errors_pct": errors}))


if __name__ == "__main__":
    main()
