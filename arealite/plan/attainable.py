"""What the staleness bound lets the asynchronous run reach on its split, before launch.

`ThroughputPlan.speedup_bound` overlaps generation and training as if the servers never idled.
Under the staleness bound they do: by version v at most ``(eta + v + 1) · B`` groups may have
started, a group holds its place until its longest answer ends, and a finished group waits for
the trainer's next take. `arealite.sim.pipeline` plays the run as events in virtual time with
nothing else on the critical path (benchmarks/scale_overlap.py measures the real system at 0.96
of it); here it is given the plan's own figures:

- the servers: the split's count, each decoding ``ThroughputPlan.batch`` answers at once under the
  cost model of `server_spec` (the card, the model's shape, ``server.sim``'s efficiencies);
- answers: ``server.sim``'s lengths (lognormal ``length_median`` / ``length_sigma``, or
  ``lengths_file``, e.g. a previous run's), cut at ``generation.max_new_tokens``;
- the rules: ``rollout.consumer_batch_size`` groups of ``generation.n_samples`` a step, the
  staleness bound at each eta, ``rollout.max_concurrent_rollouts`` per trainer rank;
- training at the plan's trained tokens/s on the split's trainer GPUs, by each batch's tokens,
  and a push that holds generation for the weights' bytes over ``server.sim.weight_gbps``, then
  ``weight_sync.pause_mode``'s cost (``retract`` / ``abort``: the answers in flight prefilled again).

A cluster of many servers is played on at most `MAX_SERVERS` of them with the batch and the
concurrency cut in proportion (each server sees the same share of the work); the table says so.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

from arealite.config.schema import ArealiteConfig
from arealite.sim.cost_model import SimSpec, load_lengths
from arealite.sim.pipeline import PipelineSetup, busy_generation_s, capped_mean, simulate_pipeline

from .throughput import ThroughputPlan

__all__ = ["AttainablePlan", "MAX_SERVERS", "plan_attainable", "window"]

#: Servers played at most; a larger split is played in proportion.
MAX_SERVERS = 4
#: The etas always shown beside the configured one.
ETAS = (1, 2, 4, 8, 16)
#: Steps measured in each play, after its start (`window`).
MEASURED_STEPS = 28


@dataclass(frozen=True)
class EtaRow:
    eta: int
    step_s: float
    """Median seconds per step over the length draws."""
    speedup: float
    """The synchronous step (eta = 0, same draws) over this one."""
    of_bound: float
    """``speedup`` over `AttainablePlan.bound`."""
    rows_busy: float
    """Share of the servers' rows decoding, on average."""


@dataclass
class AttainablePlan:
    label: str
    """Which split: ``configured`` or ``balanced``."""
    server_gpus: int
    trainer_gpus: int
    eta: int
    """The configured staleness bound."""
    sync_step_s: float
    bound: float
    """Speed-up with servers never idle and generation overlapped with training (same lengths)."""
    mean_answer: float
    lengths: str
    pause_mode: str
    rows: list[EtaRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def row(self, eta: int) -> EtaRow:
        return next(r for r in self.rows if r.eta == eta)

    def table(self) -> str:
        lines = [f"attainable under the staleness bound ({self.label} split, {self.server_gpus} server + "
                 f"{self.trainer_gpus} trainer GPUs; answers {self.lengths}, mean {self.mean_answer:,.0f} tokens; "
                 f"pushes pause_mode {self.pause_mode}): "
                 f"synchronous step {self.sync_step_s:.1f} s, bound {self.bound:.2f}x with servers never idle",
                 "  eta   s/step   speed-up   of the bound   rows busy"]
        for r in self.rows:
            mark = "  <- configured" if r.eta == self.eta else ""
            lines.append(f"  {r.eta:>3}   {r.step_s:>6.1f}   {r.speedup:>7.2f}x   {r.of_bound:>12.2f}   "
                         f"{r.rows_busy:>8.0%}{mark}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def window(eta: int) -> tuple[int, int]:
    """``(steps, skip)`` of one play: the groups admitted at the start are all of version 0 and
    stay in flight for up to eta steps, so the first ``12 + 2 eta`` steps are left out."""
    skip = 12 + 2 * eta
    return skip + MEASURED_STEPS, skip


def plan_attainable(cfg: ArealiteConfig, tp: ThroughputPlan, *, etas: tuple[int, ...] = ETAS,
                    seeds: int = 2) -> AttainablePlan | None:
    """The attainable speed-up at each eta (the configured one included) on the configured split,
    or the balanced one when the cluster does not hold the configured; None without a split."""
    label, split = ("configured", tp.configured) if tp.configured else ("balanced", (tp.server_gpus, tp.trainer_gpus))
    if split[0] is None or tp.batch < 1:
        return None
    server_gpus, trainer_gpus = split
    servers = server_gpus // tp.gpus_per_server
    played = min(servers, MAX_SERVERS)
    share = played / servers
    B = cfg.rollout.consumer_batch_size
    batch = max(1, round(B * share))
    concurrent = max(1, round(cfg.rollout.max_concurrent_rollouts * cfg.launch.n_trainer_procs * share))
    o = cfg.server.sim
    spec = replace(tp.spec, time_scale=1.0, length_median=o.length_median, length_sigma=o.length_sigma,
                   lengths=load_lengths(o.lengths_file) if o.lengths_file else ())
    cap = cfg.generation.max_new_tokens
    prompt = max(1, cfg.data.max_prompt_len or 1)
    mean = (statistics.fmean(min(n, cap) for n in spec.lengths) if spec.lengths
            else capped_mean(spec.length_median, spec.length_sigma, cap))
    n = cfg.generation.n_samples
    # Seconds per trained token of the played batch: the whole batch's tokens over the split's
    # trainer GPUs, so the played (smaller) batch trains as long as the real one.
    per_token = B / batch / (trainer_gpus * tp.train_tokens_per_s)
    push = spec.transfer_s()

    def step_s(eta: int) -> tuple[float, float]:
        steps, skip = window(eta)
        runs = [simulate_pipeline(PipelineSetup(
            spec, played, tp.batch, batch, n, eta, concurrent, cap, prompt, train_s=0.0, push_s=push,
            train_s_per_token=per_token, seed=seed, pause_mode=cfg.weight_sync.pause_mode), steps, skip)
            for seed in range(seeds)]
        return statistics.median(r.step_s(skip) for r in runs), statistics.fmean(r.rows_busy for r in runs)

    sync, _ = step_s(0)
    busy = busy_generation_s(spec, played, tp.batch, batch * n, mean, prompt + mean)
    train = per_token * batch * n * (prompt + mean) + push
    out = AttainablePlan(label, server_gpus, trainer_gpus, cfg.rollout.max_head_offpolicyness, sync,
                         sync / max(busy, train), mean, _lengths(cfg, spec, cap), cfg.weight_sync.pause_mode)
    for eta in sorted({*etas, out.eta} - {0}):
        s, rows_busy = step_s(eta)
        out.rows.append(EtaRow(eta, s, sync / s, sync / s / out.bound, rows_busy))
    if played < servers:
        out.notes.append(f"played on {played} of {servers} servers with {batch} of {B} groups a step and "
                         f"{concurrent} concurrent rollouts: each server's share of the work kept"
                         + ("" if batch == B * share else f" to rounding ({batch / share:.1f} groups)"))
    out.notes.append(f"virtual time, {MEASURED_STEPS} steps after a start of 12 + 2 eta, "
                     f"medians of {seeds} length draws; orchestration costs nothing here (the real system "
                     "reached 0.96 of it at eta 4: docs/scale.md)")
    return out


def _lengths(cfg: ArealiteConfig, spec: SimSpec, cap: int) -> str:
    o = cfg.server.sim
    if spec.lengths:
        return f"drawn from {o.lengths_file}, cut at {cap:,}"
    return (f"lognormal around {spec.length_median:,.0f} tokens, sigma {spec.length_sigma:g}, cut at {cap:,} "
            "(server.sim.length_median / length_sigma)")
