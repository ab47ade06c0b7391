"""Log-prob + entropy with gradient: the fused chunked head against materialised float32 logits.

Both sides start from the last hidden states ``h [T, H]`` and the output head's weight
``W [V, H]`` (float32, on the CPU) and compute, for T token labels, the log-prob under
``log_softmax(h @ W.T / temperature)`` with its gradient (into ``h`` and ``W``) and the entropy
of each row as a stat, i.e. what the PPO loss needs per micro-batch:

- baseline (the engine's path before issue 30): the head's ``[T, V]`` logits materialised in
  float32 (``F.linear(h, W).float()``, as ``FSDPEngine._logits`` returned them), then
  ``arealite.algo.logprob.gather_logprobs_entropy_stat``: the log-softmax over the vocabulary,
  row-chunked (1024 rows), saving only the logits for its backward (since issue 41 it is the
  same kernel as the fused side, run on the logits: ``weight=None``);
- fused: ``arealite.ops.fused_logprob.fused_logprobs_entropy`` (the head applied over
  chunks of rows; the backward recomputes each chunk's logits).

Memory: each side runs in a fresh subprocess per round; after building the inputs (and a small
warm-up) it resets the kernel's RSS high-water mark (``/proc/self/clear_refs``), runs forward
and backward, and reports ``VmHWM - VmRSS before``: the peak bytes the computation added on top
of its inputs, whatever allocated them (torch frees large CPU tensors back to the OS, so RSS
follows the live tensors). Also reported: the bytes the autograd graph kept for the backward
beyond the inputs (``saved_tensors_hooks``). Time: the wall time of forward + backward in that
process. Rounds alternate which side runs first; figures are medians over rounds, the time
ratio the median of the per-round ratios (fused / baseline).

    python benchmarks/bench_logprob.py [--rows 8192] [--vocab 151936] [--hidden 256] [--rounds 3]
                                       [--temperature 1.0] [--chunk N] [--threads N] [--quick]

The last line is one JSON object with ``logprob_mem_ratio`` (baseline / fused peak bytes; goal
>= 8) and ``logprob_time_ratio`` (fused / baseline time; goal <= 1.3).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GOAL_MEM, GOAL_TIME = 8.0, 1.3


def _proc_status(field: str) -> int:
    """A ``/proc/self/status`` size field in bytes (0 where there is no /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak() -> bool:
    """Reset the RSS high-water mark (Linux >= 4.0); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _inputs(rows: int, vocab: int, hidden: int):
    import torch

    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, hidden, generator=g).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).requires_grad_(True)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    adv = torch.randn(rows, generator=g)  # the upstream gradient of each log-prob, as a PPO loss sends
    return h, w, labels, adv


def _side(name: str, temperature: float, chunk: int | None):
    """``fn(h, w, labels) -> (logp, entropy)`` of one side."""
    import torch.nn.functional as F

    from arealite.algo.logprob import gather_logprobs_entropy_stat
    from arealite.ops.fused_logprob import fused_logprobs_entropy

    if name == "baseline":
        def baseline(h, w, labels):
            logits = F.linear(h, w).float()
            return gather_logprobs_entropy_stat(logits, labels, temperature)
        return baseline
    return lambda h, w, labels: fused_logprobs_entropy(h, w, labels, temperature, chunk_size=chunk)


def child(args: argparse.Namespace) -> None:
    """One side, one round, in this (fresh) process: prints one JSON line."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    fn = _side(args.child, args.temperature, args.chunk)
    h, w, labels, adv = _inputs(args.rows, args.vocab, args.hidden)
    n = min(64, args.rows)  # warm-up on a few rows: kernels and allocator paths initialised
    logp, _ = fn(h[:n].detach().requires_grad_(True), w, labels[:n])
    (logp * adv[:n]).sum().backward()
    w.grad = None
    inputs = {t.untyped_storage().data_ptr() for t in (h, w, labels)}
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in inputs:
            saved[st.data_ptr()] = st.nbytes()
        return t

    before = _proc_status("VmRSS")
    exact = _reset_peak()
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, ent = fn(h, w, labels)
    ent_mean = float(ent.mean())
    (logp * adv).sum().backward()
    seconds = time.perf_counter() - t0
    peak = _proc_status("VmHWM")  # since the reset; the process's lifetime peak where it could not reset
    print(json.dumps({
        "side": args.child, "seconds": seconds, "peak_bytes": max(0, peak - before), "exact_peak": exact,
        "saved_bytes": sum(saved.values()), "logp_sum": float(logp.detach().double().sum()),
        "entropy_mean": ent_mean, "grad_h_sum": float(h.grad.double().abs().sum()),
        "grad_w_sum": float(w.grad.double().abs().sum()),
    }))


def run_side(args: argparse.Namespace, side: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", side, "--rows", str(args.rows),
           "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--temperature", str(args.temperature)]
    if args.chunk:
        cmd += ["--chunk", str(args.chunk)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{side} run failed (exit {out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8192, help="T: tokens (rows of the head's output)")
    p.add_argument("--vocab", type=int, default=151_936, help="V: vocabulary (Qwen2.5's by default)")
    p.add_argument("--hidden", type=int, default=256, help="H: hidden size (small, for the CPU)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--chunk", type=int, default=None, help="rows per chunk (default: ~256 MiB of logits)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="a small smoke run (T=1024, V=32000, 1 round)")
    p.add_argument("--child", choices=["baseline", "fused"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    if args.quick:
        args.rows, args.vocab, args.rounds = 1024, 32_000, 1
    from arealite.ops.fused_logprob import chunk_rows

    chunk = args.chunk or chunk_rows(args.vocab)
    runs: dict[str, list[dict]] = {"baseline": [], "fused": []}
    for r in range(args.rounds):
        for side in (("baseline", "fused") if r % 2 == 0 else ("fused", "baseline")):
            runs[side].append(run_side(args, side))
    med = {side: {k: statistics.median(x[k] for x in rs) for k in ("seconds", "peak_bytes", "saved_bytes")}
           for side, rs in runs.items()}
    mem_ratio = med["baseline"]["peak_bytes"] / max(1, med["fused"]["peak_bytes"])
    time_ratio = statistics.median(f["seconds"] / b["seconds"] for f, b in zip(runs["fused"], runs["baseline"]))
    b0, f0 = runs["baseline"][0], runs["fused"][0]
    agree = max(_rel(f0[k], b0[k]) for k in ("logp_sum", "entropy_mean", "grad_h_sum", "grad_w_sum"))
    gib = 1 << 30
    print(f"log-prob + entropy with gradient: T={args.rows}, V={args.vocab}, H={args.hidden}, float32, "
          f"temperature {args.temperature}, fused chunk {chunk} rows, {args.rounds} rounds (medians), "
          f"{os.cpu_count()} CPUs")
    print(f"{'side':<9} {'peak GiB':>9} {'saved GiB':>10} {'seconds':>8}")
    for side in ("baseline", "fused"):
        m = med[side]
        print(f"{side:<9} {m['peak_bytes'] / gib:>9.3f} {m['saved_bytes'] / gib:>10.3f} {m['seconds']:>8.2f}")
    print(f"memory ratio (baseline / fused peak) {mem_ratio:.1f} (goal >= {GOAL_MEM:g}); time ratio (fused / "
          f"baseline) {time_ratio:.2f} (goal <= {GOAL_TIME:g}); sums agree to {agree:.1e} (relative)")
    print(json.dumps({
        "benchmark": "bench_logprob", "rows": args.rows, "vocab": args.vocab, "hidden": args.hidden,
        "dtype": "float32", "temperature": args.temperature, "chunk_rows": chunk, "rounds": args.rounds,
        "baseline_peak_bytes": med["baseline"]["peak_bytes"], "fused_peak_bytes": med["fused"]["peak_bytes"],
        "baseline_saved_bytes": med["baseline"]["saved_bytes"], "fused_saved_bytes": med["fused"]["saved_bytes"],
        "baseline_seconds": med["baseline"]["seconds"], "fused_seconds": med["fused"]["seconds"],
        "peak_measure": "rss_high_water_reset" if all(x["exact_peak"] for rs in runs.values() for x in rs)
        else "rss_high_water_lifetime",
        "max_rel_diff": agree, "logprob_mem_ratio": mem_ratio, "logprob_time_ratio": time_ratio,
        "goal_mem": GOAL_MEM, "goal_time": GOAL_TIME,
        "goals_met": mem_ratio >= GOAL_MEM and time_ratio <= GOAL_TIME,
    }))


if __name__ == "__main__":
    main()
