"""The planner's trainer memory against ``torch.cuda.max_memory_allocated`` on one GPU (issue 45).

A randomly initialised model of Qwen2.5-1.5B's shape (bench_mfu's config.json, nothing
downloaded; float32 master weights, AdamW, bfloat16 compute) trains one step in `FSDPEngine`
(a world of one) on a packed micro-batch of answers of at most 8,192 tokens, at two layouts
(activation checkpointing off and on) and two lengths each:

- plain, 4k and 16k tokens per micro-batch; checkpointed, 16k and 64k (at 4k and 16k the
  checkpointed step's peak is the optimizer's, the same at both: 64k makes the activations count);
- each layout's engine warms up one step (AdamW's state allocated), then every length is one
  measured step: ``reset_peak_memory_stats()``, ``train_batch``, ``max_memory_allocated()`` less
  what was allocated before the engine was built; the prediction is `trainer_rank_memory(cfg,
  device="cuda", seq_lens=..., n_microbatches=1)` of the same config and lengths;
- last, one configuration the planner says will not fit: the shortest of `OOM_LADDER` (no
  checkpointing) predicted over ``OOM_MARGIN`` x the card's memory, which must really raise
  ``torch.OutOfMemoryError`` (``oom_confirmed``).

    python benchmarks/bench_plan_gpu.py            # on a CUDA machine; run by ci/gpu_local.sh
    python benchmarks/bench_plan_gpu.py --dry-run  # the same code on the CPU, tiny sizes

``--dry-run`` runs every path on the CPU with the ``micro`` tiny model in float32: the measured
peak is the live tensor bytes of `arealite.plan.measured.step_peak`, the card a ``--capacity-mib``
budget that `CapacityGuard` enforces by raising ``torch.OutOfMemoryError`` (a simulated
out-of-memory, reported as such). Without CUDA and without ``--dry-run`` it says so and exits 0.

Prints a table, then as its last line one JSON object: ``max_abs_error_pct`` and ``errors_pct``
per configuration (goal: each within 10%), the ``oom`` check with ``oom_confirmed``, ``goal_met``.
Exits 1 when a goal is missed. About a minute on an H100 (two engines, seven steps).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arealite.config.schema import ArealiteConfig  # noqa: E402
from arealite.plan.activations import LiveBytes  # noqa: E402
from arealite.plan.measured import step_peak  # noqa: E402
from arealite.plan.model_shapes import model_shapes  # noqa: E402
from arealite.plan.trainer_memory import trainer_rank_memory  # noqa: E402
from arealite.train_engine.fsdp import FSDPEngine  # noqa: E402
from benchmarks.bench_mfu import (  # noqa: E402  (the same model and loss as the MFU benchmark)
    RandomInitEngine, batch_of, n_loss_tokens, token_mean_nll, write_config,
)

MIB = 2**20
GOAL_PCT = 10.0
#: How far over the card a configuration must be predicted for its out-of-memory to be certain
#: (the planner's goal error is 10%, and what it leaves out only adds).
OOM_MARGIN = 1.25


@dataclass(frozen=True)
class Mode:
    """Where the validation runs and at which sizes."""

    device: str
    cases: dict[str, tuple[bool, int]]
    """name -> (activation checkpointing, tokens per micro-batch)."""
    max_seq: int
    """The longest answer: a micro-batch packs answers of this length (and one shorter)."""
    oom_ladder: tuple[int, ...]
    """Tokens per micro-batch tried for the out-of-memory check, shortest first (no checkpointing)."""


GPU = Mode("cuda", {"plain-4k": (False, 4096), "plain-16k": (False, 16384),
                    "ckpt-16k": (True, 16384), "ckpt-64k": (True, 65536)},
           max_seq=8192, oom_ladder=(32768, 49152, 65536, 98304, 131072, 196608, 262144))
DRY = Mode("cpu", {"plain-128": (False, 128), "plain-512": (False, 512),
                   "ckpt-512": (True, 512), "ckpt-2048": (True, 2048)},
           max_seq=128, oom_ladder=(4096, 8192, 16384, 32768))


def answer_lengths(tokens: int, max_seq: int) -> list[int]:
    """``tokens`` as answers of ``max_seq`` tokens and one shorter rest."""
    n, rest = divmod(tokens, max_seq)
    return [max_seq] * n + ([rest] if rest else [])


def run_config(model_dir: Path, checkpointing: bool, mb_tokens: int) -> ArealiteConfig:
    """The run both the engine and the planner see (``dtype: auto``: bf16 on a GPU, fp32 on the CPU)."""
    return ArealiteConfig.model_validate({"actor": {
        "model_path": str(model_dir), "mb_max_tokens": mb_tokens, "gradient_checkpointing": checkpointing,
        "optimizer": {"lr": 1e-6, "gradient_clipping": 1.0}}})


class CapacityGuard(LiveBytes):
    """The dry run's card: raises ``torch.OutOfMemoryError`` when the storages made during the
    step, over the ``resident`` bytes alive before it, pass ``capacity`` (a CPU has no limit)."""

    def __init__(self, capacity: int, resident: int) -> None:
        super().__init__()
        self.capacity, self.resident = capacity, resident

    def track(self, t: torch.Tensor) -> None:
        super().track(t)
        if self.resident + self.now > self.capacity:
            raise torch.OutOfMemoryError(f"simulated: {(self.resident + self.now) / MIB:.1f} MiB alive over the "
                                         f"{self.capacity / MIB:.1f} MiB budget")


def resident_bytes(engine) -> int:
    """The bytes a trainer holds between steps: its parameters' local shards and AdamW's state."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in engine.model.parameters()]
    state = [v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(t.untyped_storage().nbytes() for t in local + state)


def on_card(engine, capacity: int):
    """The card's limit around a step: the GPU's own, or on the CPU a `CapacityGuard`."""
    if engine.device.type == "cuda":
        return contextlib.nullcontext()
    return CapacityGuard(capacity, resident_bytes(engine))


def measured_peak(engine, batch, baseline: int, capacity: int) -> int:
    """One train step's peak: ``max_memory_allocated`` on a GPU, live tensor bytes on the CPU."""
    with on_card(engine, capacity):
        if engine.device.type != "cuda":
            return step_peak(engine, batch, token_mean_nll, n_loss_tokens)["peak"]
        torch.cuda.reset_peak_memory_stats()
        engine.train_batch(batch, token_mean_nll, n_loss_tokens)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - baseline


def try_oom(engine, batch, capacity: int) -> tuple[bool, str]:
    """Train one step expected not to fit: ``(raised torch.OutOfMemoryError, what was said)``."""
    try:
        with on_card(engine, capacity):
            engine.train_batch(batch, token_mean_nll, n_loss_tokens)
    except torch.OutOfMemoryError as e:
        return True, str(e).splitlines()[0][:300]
    return False, "the step ran: no out-of-memory"


def free_device() -> int:
    """Release what the previous engine left; the bytes still allocated (the next baseline)."""
    gc.collect()
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def run_layout(mode: Mode, model_dir: Path, checkpointing: bool, names: list[str], vocab: int,
               oom_tokens: int | None, capacity: int) -> tuple[dict[str, int | None], dict | None]:
    """One engine of one layout: a warm-up step, then a measured step per case of ``names``,
    then the out-of-memory attempt at ``oom_tokens`` (if any). Returns the measured peaks and
    the attempt's result (a case that ran out of memory measures None)."""
    tokens = {n: mode.cases[n][1] for n in names}
    baseline = free_device()
    cfg = run_config(model_dir, checkpointing, max([*tokens.values(), oom_tokens or 0]))
    engine_cls = RandomInitEngine if mode.device == "cuda" else FSDPEngine
    engine = engine_cls(cfg.actor, device=mode.device).initialize(total_steps=100)
    peaks: dict[str, int | None] = {}
    oom = None
    try:
        first = min(tokens.values())
        engine.train_batch(batch_of(answer_lengths(first, mode.max_seq), vocab, 0), token_mean_nll, n_loss_tokens)
        for name, n in tokens.items():
            try:
                peaks[name] = measured_peak(engine, batch_of(answer_lengths(n, mode.max_seq), vocab, 1), baseline,
                                            capacity)
            except torch.OutOfMemoryError as e:  # a case meant to fit did not: no figure, the goal missed
                peaks[name], said = None, f"out of memory ({str(e).splitlines()[0][:200]})"
            if peaks[name] is None:
                free_device()  # out of the except block: its traceback no longer holds the step's tensors
            print(f"  measured {name}: {said if peaks[name] is None else f'{peaks[name] / MIB:.1f} MiB'}", flush=True)
        if oom_tokens:
            raised, said = try_oom(engine, batch_of(answer_lengths(oom_tokens, mode.max_seq), vocab, 2), capacity)
            oom = {"raised": raised, "said": said}
    finally:
        engine.destroy()
        del engine
        free_device()
    return peaks, oom


def plan_of(model_dir: Path, shapes, mode: Mode, checkpointing: bool, tokens: int):
    cfg = run_config(model_dir, checkpointing, tokens)
    return trainer_rank_memory(cfg, device=mode.device, seq_lens=answer_lengths(tokens, mode.max_seq),
                               n_microbatches=1, shapes=shapes)


def pick_oom(model_dir: Path, shapes, mode: Mode, capacity: int) -> tuple[int | None, int]:
    """The shortest ladder length predicted over ``OOM_MARGIN`` x ``capacity``: ``(tokens, bytes)``."""
    predicted = 0
    for tokens in mode.oom_ladder:
        predicted = plan_of(model_dir, shapes, mode, False, tokens).total
        if predicted > OOM_MARGIN * capacity:
            return tokens, predicted
    return None, predicted


def validate(mode: Mode, model_dir: Path, capacity: int) -> dict:
    """Predict and measure every case, then the out-of-memory check; the JSON line's content."""
    shapes = model_shapes(str(model_dir))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    predicted = {n: plan_of(model_dir, shapes, mode, ck, t).total for n, (ck, t) in mode.cases.items()}
    oom_tokens, oom_predicted = pick_oom(model_dir, shapes, mode, capacity)
    measured: dict[str, int | None] = {}
    oom = None
    for checkpointing in (True, False):  # the out-of-memory attempt last, on the plain engine
        names = [n for n, (ck, _) in mode.cases.items() if ck == checkpointing]
        peaks, tried = run_layout(mode, model_dir, checkpointing, names, vocab,
                                  None if checkpointing else oom_tokens, capacity)
        measured.update(peaks)
        oom = tried or oom
    errors = {n: None if measured[n] is None else round(100 * (predicted[n] - measured[n]) / measured[n], 2)
              for n in mode.cases}
    print(f"{'configuration':14} {'tokens':>7} {'predicted MiB':>14} {'measured MiB':>13} {'error %':>8}")
    for n, (_, t) in mode.cases.items():
        got = "out of memory" if measured[n] is None else f"{measured[n] / MIB:13.1f} {errors[n]:8.1f}"
        print(f"{n:14} {t:7d} {predicted[n] / MIB:14.1f} {got:>22}")
    confirmed = bool(oom and oom["raised"])
    check = {"tokens": oom_tokens, "predicted_mib": round(oom_predicted / MIB, 1),
             "capacity_mib": round(capacity / MIB, 1), "simulated": mode.device != "cuda",
             "oom_confirmed": confirmed, "said": oom["said"] if oom else
             f"no ladder length predicted over {OOM_MARGIN} x the card: not tried"}
    print(f"out of memory at {oom_tokens} tokens (predicted {check['predicted_mib']:.0f} MiB, card "
          f"{check['capacity_mib']:.0f} MiB): {'confirmed' if confirmed else 'NOT confirmed'}: {check['said']}")
    worst = max(float("inf") if e is None else abs(e) for e in errors.values())
    return {"measured": True, "max_abs_error_pct": worst if worst < float("inf") else None,
            "errors_pct": errors, "predicted_mib": {n: round(v / MIB, 1) for n, v in predicted.items()},
            "measured_mib": {n: None if measured[n] is None else round(measured[n] / MIB, 1) for n in mode.cases},
            "oom_confirmed": confirmed, "oom": check, "goal_pct": GOAL_PCT,
            "goal_met": worst <= GOAL_PCT and confirmed}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="the same code on the CPU with the micro tiny model")
    p.add_argument("--model", type=Path, default=None,
                   help="--dry-run: a tiny model directory to use (default: the micro model, built here)")
    p.add_argument("--capacity-mib", type=float, default=None,
                   help="--dry-run: the simulated card's memory (default 24 MiB); a GPU's is its own")
    args = p.parse_args(argv)
    if args.capacity_mib is not None and not args.dry_run:
        p.error("--capacity-mib: only with --dry-run (on a GPU the card's own memory is the limit)")
    if not args.dry_run and not torch.cuda.is_available():
        print("bench_plan_gpu: needs a CUDA device (none here); not measured (--dry-run runs it on the CPU)")
        result = {"measured": False, "reason": "no CUDA device"}
        print(json.dumps(result))
        return result
    tmp = Path(tempfile.mkdtemp(prefix="bench_plan_gpu_"))
    if args.dry_run:
        from arealite.models.tiny import build_tiny_model

        mode, device_name = DRY, "cpu (dry run)"
        model_dir = args.model or build_tiny_model(tmp / "model", size="micro", seed=0)
        capacity = int((args.capacity_mib or 24) * MIB)
    else:
        mode, device_name = GPU, torch.cuda.get_device_name()
        model_dir = write_config(tmp / "model", None)
        capacity = torch.cuda.mem_get_info()[1]
    print(f"bench_plan_gpu on {device_name}: card {capacity / MIB:.0f} MiB", flush=True)
    result = {**validate(mode, Path(model_dir), capacity), "device": device_name,
              "torch": torch.__version__}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    outcome = main()
    sys.exit(0 if not outcome["measured"] or outcome["goal_met"] else 1)
