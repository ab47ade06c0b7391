"""Per-rank memory and time of one training step under each parallel layout, against one process.

The same tiny model (``--model``, default ``base``: 8 layers, hidden 320, 8 query heads sharing 4
KV heads, MLP 960) trains on the same long sequences (``--seqs`` of ``--seq-len`` tokens, packed
into one micro-batch) with the token-mean log-likelihood loss, float32 on the CPU, in these layouts:

- ``single``: one process (FSDPEngine, a world of one);
- ``sp2``: 2 gloo ranks under ``torchrun``, ``actor.sp_size=2`` (each rank computes half the tokens);
- ``tp2``: 2 gloo ranks, ``actor.tp_size=2`` (each rank computes half of each layer's projections);
- ``sp2_tp2``: 4 ranks, ``sp_size=2, tp_size=2`` (a quarter of the heads' work and of the
  projections, half the tokens of everything else);
- ``dp_replicate2_sp2``: 4 ranks, ``dp_replicate=2, sp_size=2`` (two replicas of an sp2 group,
  parameters sharded over the 2 ranks of a replica).

and a mixture-of-experts model of the same shape (``--moe``, default ``moe-base``: the dense
model's dimensions, every layer 8 experts of width 480, top-2, so as many active MLP weights
per token as the dense MLP; built with ``build_tiny_model(size="moe-small", **dims)``) in:

- ``moe_single``: one process;
- ``ep2_sp2``: 4 ranks, ``ep_size=2, sp_size=2`` (each rank half the tokens, half the experts);
- ``ep2_tp2``: 4 ranks, ``ep_size=2, tp_size=2`` (attention split by tp, experts by ep).

Every layout computes the same micro-batch: a model-parallel group (the ``sp x tp`` ranks) is
handed the single process's rows, split among its ranks (the engine gathers them), and every
data-parallel group gets the same rows again, so that each rank's figure is that of one
micro-batch, whatever the layout.

In every process, after loading and one warm-up step (optimizer state allocated), the kernel's
RSS high-water mark is reset (``/proc/self/clear_refs``) and one step runs; its peak is
``VmHWM - VmRSS before``: the bytes the step added on top of the model and optimizer state
(activations, gradients, communication buffers). glibc's malloc is told to map every block
over 128 KiB on its own (``MALLOC_MMAP_THRESHOLD_``), so freed tensors go back to the kernel and
RSS follows the live ones (otherwise the warm-up's freed heap hides the step's peak); that
makes every large allocation a fresh mapping, so the step time comes from a second run of each
layout with malloc as usual. Also counted, exactly: the bytes autograd saves for the backward
during the step's forward (``saved_tensors_hooks``, each storage once; this includes the
weights the matmuls save). The figure of a parallel layout is its largest rank's. Time is the
step's wall time (2 or 4 processes on a 2-core machine share the cores, so the time ratio says
what the communication and the split cost here, not what a GPU cluster sees). Layouts
alternate order each round; figures are medians over ``--rounds``, with the spread (lowest and
highest ratio of a round) beside them.

    python benchmarks/bench_parallel.py [--model base] [--moe moe-base] [--seq-len 2048] [--seqs 2]
                                        [--rounds 3] [--layouts single,sp2,...]

The last line is one JSON object: for each parallel layout ``L``, ``L_mem_ratio`` (single ÷ the
largest rank's peak step bytes; 2 would be a perfect split over 2 ranks), ``L_saved_ratio``
(the same for the bytes saved for the backward), ``L_time_ratio`` (parallel ÷ single step
time) and ``L_mem_ratio_runs`` (each round's); the MoE layouts against ``moe_single``. The
issue's goal figures also come under their own names: ``mem_ratio_sp2_tp2`` and
``saved_ratio_sp2_tp2`` (goal: at least 3), and likewise ``mem_ratio_L`` for every 4-rank layout.
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
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_mfu import n_loss_tokens, token_mean_nll  # noqa: E402  (the same loss as the GPU benchmark)


@dataclass(frozen=True)
class Layout:
    """One benchmarked layout: the engine fields it sets, its ranks, and the model it trains."""

    fields: dict = field(default_factory=dict)
    ranks: int = 1
    model: str = "dense"  # "dense" (--model) or "moe" (--moe)

    @property
    def baseline(self) -> str:
        return "single" if self.model == "dense" else "moe_single"


LAYOUTS: dict[str, Layout] = {
    "single": Layout(),
    "sp2": Layout({"sp_size": 2}, 2),
    "tp2": Layout({"tp_size": 2}, 2),
    "sp2_tp2": Layout({"sp_size": 2, "tp_size": 2}, 4),
    "dp_replicate2_sp2": Layout({"dp_replicate": 2, "sp_size": 2}, 4),
    "moe_single": Layout(model="moe"),
    "ep2_sp2": Layout({"ep_size": 2, "sp_size": 2}, 4, "moe"),
    "ep2_tp2": Layout({"ep_size": 2, "tp_size": 2}, 4, "moe"),
}

#: ``--moe moe-base``: the dense ``base`` model's shape with every MLP made 8 experts of width
#: 480, top-2 (960 active MLP width per token, as the dense model's).
MOE_BASE = dict(hidden_size=320, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=40,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=480, vocab_size=1024)


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _rows(engine) -> slice:
    """This rank's share of the micro-batch's rows: every model-parallel group gets all of them
    (the ``sp x tp`` ranks of a group are neighbours, ``tp`` innermost), split among its ranks."""
    size = engine.layout.group_size
    return slice(engine.rank % size, None, size)


def child(model_dir: str, layout: str, seq_len: int, seqs: int, out: str) -> None:
    """One rank: warm up, then measure one step's added peak RSS and time; writes ``out.<rank>``."""
    import torch.distributed as dist

    from arealite.config.schema import ActorConfig
    from arealite.train_engine.fsdp import FSDPEngine

    cfg = ActorConfig(model_path=model_dir, mb_max_tokens=seq_len * seqs, **LAYOUTS[layout].fields)
    engine = FSDPEngine(cfg, device="cpu").initialize(total_steps=100)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, engine.hf_config.vocab_size, (seqs, seq_len), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    rows = _rows(engine)
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
    return {"peak_bytes": memory["peak_bytes"], "saved_bytes": memory["saved_bytes"], "step_s": timing["step_s"],
            "rank_peak_bytes": memory["rank_peak_bytes"]}


def _run(model_dir: Path, layout: str, args, tmp: Path, extra_env: dict[str, str]) -> dict:
    out = tmp / f"{layout}-{time.monotonic_ns()}"
    ranks = LAYOUTS[layout].ranks
    env = {**os.environ, "OMP_NUM_THREADS": "1" if ranks > 1 else str(args.threads), **extra_env}
    child_args = [str(Path(__file__).resolve()), "--child", str(model_dir), layout, str(args.seq_len),
                  str(args.seqs), str(out)]
    if ranks == 1:
        cmd = [sys.executable, *child_args]
    else:
        from arealite.utils.dist import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), *child_args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{layout} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    per_rank = [json.loads(p.read_text()) for p in sorted(tmp.glob(out.name + ".*"), key=lambda p: int(p.suffix[1:]))]
    figures = {k: max(r[k] for r in per_rank) for k in ("peak_bytes", "saved_bytes", "step_s")}
    return {**figures, "rank_peak_bytes": [r["peak_bytes"] for r in per_rank]}


def build_models(args, tmp: Path, names: list[str]) -> dict[str, Path]:
    """The model directories the chosen layouts train (``dense`` and/or ``moe``)."""
    from arealite.models.tiny import build_tiny_model

    dirs = {}
    if any(LAYOUTS[n].model == "dense" for n in names):
        dirs["dense"] = build_tiny_model(tmp / "dense", size=args.model, seed=0)
    if any(LAYOUTS[n].model == "moe" for n in names):
        if args.moe == "moe-base":
            dirs["moe"] = build_tiny_model(tmp / "moe", size="moe-small", seed=0, **MOE_BASE)
        else:
            dirs["moe"] = build_tiny_model(tmp / "moe", size=args.moe, seed=0)
    return dirs


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def summarise(runs: dict[str, list[dict]], args) -> dict:
    """The medians of each layout, and every parallel layout's ratios against its baseline."""
    keys = ("peak_bytes", "saved_bytes", "step_s")
    med = {n: {k: statistics.median(x[k] for x in runs[n]) for k in keys} for n in runs}
    result = {"model": args.model, "moe": args.moe, "tokens": args.seq_len * args.seqs, "rounds": args.rounds,
              **{f"{n}_{k}": med[n][k] for n in runs for k in keys}}
    for n in runs:
        base = LAYOUTS[n].baseline
        if n == base or base not in runs:
            continue
        per_round = [_ratio(a["peak_bytes"], b["peak_bytes"]) for a, b in zip(runs[base], runs[n])]
        result[f"{n}_mem_ratio"] = _ratio(med[base]["peak_bytes"], med[n]["peak_bytes"])
        result[f"{n}_saved_ratio"] = _ratio(med[base]["saved_bytes"], med[n]["saved_bytes"])
        result[f"{n}_time_ratio"] = _ratio(med[n]["step_s"], med[base]["step_s"])
        result[f"{n}_mem_ratio_runs"] = per_round
        result[f"{n}_rank_peak_bytes"] = [statistics.median(r) for r in zip(*(x["rank_peak_bytes"] for x in runs[n]))]
        if LAYOUTS[n].ranks > 2:  # the issue's names for the composed layouts' figures
            result[f"mem_ratio_{n}"] = result[f"{n}_mem_ratio"]
            result[f"saved_ratio_{n}"] = result[f"{n}_saved_ratio"]
    return result


def print_table(result: dict, names: list[str], args) -> None:
    tokens = result["tokens"]
    print(f"model {args.model} / {args.moe}, {args.seqs} x {args.seq_len} tokens per step, median of "
          f"{args.rounds} rounds (ratio: baseline / layout, per-round range in brackets)")
    print(f"{'layout':18} {'ranks':>5} {'step peak MiB/rank':>19} {'KiB/token':>10} {'saved for bwd MiB':>18} "
          f"{'mem ratio':>20} {'saved ratio':>11} {'step s':>8}")
    for n in names:
        peak, saved = result[f"{n}_peak_bytes"], result[f"{n}_saved_bytes"]
        ratio, saved_ratio = "", ""
        if f"{n}_mem_ratio" in result:
            runs = result[f"{n}_mem_ratio_runs"]
            ratio = f"{result[f'{n}_mem_ratio']:.2f}x [{min(runs):.2f}-{max(runs):.2f}]"
            saved_ratio = f"{result[f'{n}_saved_ratio']:.2f}x"
        print(f"{n:18} {LAYOUTS[n].ranks:5} {peak / 2**20:19.1f} {peak / tokens / 1024:10.1f} {saved / 2**20:18.1f} "
              f"{ratio:>20} {saved_ratio:>11} {result[f'{n}_step_s']:8.2f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="base", choices=["micro", "small", "base", "large"])
    p.add_argument("--moe", default="moe-base", choices=["moe-micro", "moe-small", "moe-wide", "moe-base"])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--seqs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of: " + ", ".join(LAYOUTS))
    p.add_argument("--threads", type=int, default=2, help="threads of a single process (each rank gets 1)")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]), int(args.child[3]), args.child[4])
        return
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        p.error(f"--layouts: unknown {unknown}; choose from {list(LAYOUTS)}")
    tmp = Path(tempfile.mkdtemp(prefix="bench_parallel_"))
    models = build_models(args, tmp, names)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(run_layout(models[LAYOUTS[name].model], name, args, tmp))
            print(f"round {r + 1}/{args.rounds} {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    result = summarise(runs, args)
    print_table(result, names, args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
