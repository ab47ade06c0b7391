"""Per-rank memory and time of one training step: sequence and tensor parallelism against one process.

The same tiny model (``--model``, default ``base``: 8 layers, hidden 320, 8 query heads sharing 4
KV heads, MLP 960) trains on the same long sequences (``--seqs`` of ``--seq-len`` tokens, packed
into one micro-batch) with the token-mean log-likelihood loss, float32 on the CPU, in three
layouts:

- ``single``: one process (FSDPEngine, a world of one);
- ``sp2``: 2 gloo ranks under ``torchrun``, ``actor.sp_size=2`` (each rank computes half the tokens);
- ``tp2``: 2 gloo ranks, ``actor.tp_size=2`` (each rank computes half of each layer's projections).

In every process, after loading and one warm-up step (optimizer state allocated), the kernel's
RSS high-water mark is reset (``/proc/self/clear_refs``) and one step runs; its peak is
``VmHWM - VmRSS before``: the bytes the step added on top of the model and optimizer state
(activations, gradients, communication buffers). glibc's malloc is told to map every block
over 128 KiB on its own (``MALLOC_MMAP_THRESHOLD_``), so freed tensors go back to the kernel and
RSS follows the live ones (otherwise the warm-up's freed heap hides the step's peak); that
makes every large allocation a fresh mapping, so the step time comes from a second run of each
layout with malloc as usual. Also
counted, exactly: the bytes autograd saves for the backward during the step's forward
(``saved_tensors_hooks``, each storage once; this includes the weights the matmuls save). The
figure of a parallel layout is its largest rank's. Time is the step's wall time (2 processes on a 2-core machine share the cores, so the
time ratio says what the communication and the split cost here, not what a GPU cluster sees).
Layouts alternate order each round; figures are medians over ``--rounds``.

    python benchmarks/bench_parallel.py [--model base] [--seq-len 2048] [--seqs 2] [--rounds 3]

The last line is one JSON object: ``sp2_mem_ratio`` and ``tp2_mem_ratio`` (single ÷ parallel peak
step bytes per rank; 2 would be a perfect split), ``sp2_saved_ratio`` and ``tp2_saved_ratio``
(the same for the bytes saved for the backward), ``sp2_time_ratio`` and ``tp2_time_ratio``
(parallel ÷ single step time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_mfu import n_loss_tokens, token_mean_nll  # noqa: E402  (the same loss as the GPU benchmark)

LAYOUTS = {"single": {}, "sp2": {"sp_size": 2}, "tp2": {"tp_size": 2}}


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def child(model_dir: str, layout: str, seq_len: int, seqs: int, out: str) -> None:
    """One rank: warm up, then measure one step's added peak RSS and time; writes ``out.<rank>``."""
    import torch.distributed as dist

    from arealite.config.schema import ActorConfig
    from arealite.train_engine.fsdp import FSDPEngine

    cfg = ActorConfig(model_path=model_dir, mb_max_tokens=seq_len * seqs, **LAYOUTS[layout])
    engine = FSDPEngine(cfg, device="cpu").initialize(total_steps=100)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, engine.hf_config.vocab_size, (seqs, seq_len), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    # Each rank hands the engine its own rows (a parallel group gathers them); one process takes all.
    rows = slice(None) if engine.world_size == 1 else slice(engine.rank, None, engine.world_size)
    batch = {"input_ids": ids[rows], "attention_mask": mask[rows], "loss_mask": mask[rows]}
    engine.train_batch(batch, token_mean_nll, n_loss_tokens)
    if dist.is_initialized():
        dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kb("VmRSS")
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: its shard on this rank
        storage = local.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        engine.train_batch(batch, token_mean_nll, n_loss_tokens)
    elapsed = time.perf_counter() - t0
    peak = (_status_kb("VmHWM") - before) * 1024
    Path(f"{out}.{engine.rank}").write_text(json.dumps({"peak_bytes": peak, "step_s": elapsed,
                                                        "saved_bytes": sum(saved.values())}))
    engine.destroy()


def run_layout(model_dir: Path, layout: str, args, tmp: Path) -> dict:
    """Memory figures from a run with every large block mapped on its own, time from a plain run."""
    memory = _run(model_dir, layout, args, tmp, {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)})
    timing = _run(model_dir, layout, args, tmp, {})
    return {"peak_bytes": memory["peak_bytes"], "saved_bytes": memory["saved_bytes"], "step_s": timing["step_s"]}


def _run(model_dir: Path, layout: str, args, tmp: Path, extra_env: dict[str, str]) -> dict:
    out = tmp / f"{layout}-{time.monotonic_ns()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1" if layout != "single" else str(args.threads), **extra_env}
    child_args = [str(Path(__file__).resolve()), "--child", str(model_dir), layout, str(args.seq_len),
                  str(args.seqs), str(out)]
    if layout == "single":
        cmd = [sys.executable, *child_args]
    else:
        from arealite.utils.dist import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), *child_args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{layout} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(tmp.glob(out.name + ".*"))]
    return {k: max(r[k] for r in ranks) for k in ("peak_bytes", "saved_bytes", "step_s")}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="base", choices=["micro", "small", "base", "large"])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--seqs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="threads of the single process (each rank gets 1)")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]), int(args.child[3]), args.child[4])
        return
    from arealite.models.tiny import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench_parallel_"))
    model_dir = build_tiny_model(tmp / "model", size=args.model, seed=0)
    names = list(LAYOUTS)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(run_layout(model_dir, name, args, tmp))
            print(f"round {r + 1}/{args.rounds} {name}: {runs[name][-1]}", file=sys.stderr)
    tokens = args.seq_len * args.seqs
    keys = ("peak_bytes", "saved_bytes", "step_s")
    med = {n: {k: statistics.median(x[k] for x in runs[n]) for k in keys} for n in names}
    print(f"model {args.model}, {args.seqs} x {args.seq_len} tokens per step, median of {args.rounds} rounds")
    print(f"{'layout':8} {'step peak MiB/rank':>19} {'KiB/token':>10} {'saved for bwd MiB':>18} {'step s':>8}")
    for n in names:
        m = med[n]
        print(f"{n:8} {m['peak_bytes'] / 2**20:19.1f} {m['peak_bytes'] / tokens / 1024:10.1f} "
              f"{m['saved_bytes'] / 2**20:18.1f} {m['step_s']:8.2f}")
    result = {"model": args.model, "tokens": tokens, "rounds": args.rounds,
              **{f"{n}_{k}": med[n][k] for n in names for k in keys}}
    for n in ("sp2", "tp2"):
        result[f"{n}_mem_ratio"] = med["single"]["peak_bytes"] / med[n]["peak_bytes"]
        result[f"{n}_saved_ratio"] = med["single"]["saved_bytes"] / med[n]["saved_bytes"]
        result[f"{n}_time_ratio"] = med[n]["step_s"] / med["single"]["step_s"]
        result[f"{n}_mem_ratio_runs"] = [a["peak_bytes"] / b["peak_bytes"] for a, b in zip(runs["single"], runs[n])]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
