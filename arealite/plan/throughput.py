"""How fast the run can go on a cluster: generation tokens/s of one server (the simulator's cost
model, `arealite.sim.cost_model.SimSpec`, with the run's own model shape), training tokens/s of
one trainer GPU (model FLOPs at an MFU), the split of the cluster's GPUs between servers and
trainer that balances the two, and the asynchronous speed-up bound at the configured eta.

The speed-up bound is the one docs/scale.md states: with generation and training on separate
GPUs, a synchronous step (eta = 0) waits for one and then the other, ``gen + train``; an
asynchronous one overlaps them, ``max(gen, train)``. With every answer of the configured maximum
length, eta >= 1 already allows the whole overlap. Long-tailed lengths and the staleness bound's
hold on the servers are played by `arealite.plan.attainable`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from arealite.config.schema import ArealiteConfig
from arealite.server.command_line import gpus_per_server
from arealite.sim.cost_model import ModelSpec, SimSpec
from arealite.train_engine.parallel.layout import ParallelLayout

from .gpus import Cluster
from .server_memory import ModelSize, answer_tokens, model_size, read_model_config, server_memory

__all__ = ["MEASURED_MFU", "ThroughputPlan", "plan_throughput", "server_spec"]

#: Training MFU measured by `benchmarks/bench_mfu.py` (docs/training.md): a Qwen2.5-1.5B-shaped
#: model, bf16, packed long-tailed RL batches, on one NVIDIA H200; one run of 4 timed steps.
MEASURED_MFU = 0.313
_MFU_SOURCE = "measured: bench_mfu, Qwen2.5-1.5B shape, one H200 (docs/training.md)"


@dataclass
class ThroughputPlan:
    """Rates per server and per trainer GPU, and what they make of the cluster."""

    cluster: Cluster
    gpus_per_server: int
    batch: int
    """Answers decoding together on one server (its concurrency, capped by
    ``rollout.max_inflight_per_server``)."""
    spec: SimSpec
    """One server in the simulator's cost model (`server_spec`)."""
    gen_tokens_per_s: float
    """Generated tokens per second of one server."""
    train_tokens_per_s: float
    """Trained tokens (prompt and answer) per second of one trainer GPU."""
    mfu: float
    mfu_source: str
    answers_per_step: int
    answer_tokens: int
    new_tokens: int
    eta: int
    server_gpus: int | None = None
    """The balanced split (None when the cluster cannot hold one server and one trainer GPU)."""
    trainer_gpus: int | None = None
    configured: tuple[int, int] | None = None
    """The config's own split (server GPUs, trainer GPUs), when the cluster holds it."""
    notes: list[str] = field(default_factory=list)

    def gen_s(self, server_gpus: int) -> float:
        """Seconds the servers on ``server_gpus`` take to generate one step's answers."""
        servers = server_gpus // self.gpus_per_server
        rate = servers * self.gen_tokens_per_s
        return self.answers_per_step * self.new_tokens / rate if rate > 0 else float("inf")

    def train_s(self, trainer_gpus: int) -> float:
        """Seconds ``trainer_gpus`` take to train one step's tokens."""
        return self.answers_per_step * self.answer_tokens / (trainer_gpus * self.train_tokens_per_s)

    def speedup_bound(self, server_gpus: int, trainer_gpus: int) -> float:
        """Synchronous step over asynchronous step on this split: 1 at eta = 0."""
        g, t = self.gen_s(server_gpus), self.train_s(trainer_gpus)
        if self.eta == 0 or g == float("inf"):
            return 1.0
        return (g + t) / max(g, t)

    def table(self) -> str:
        c = self.cluster
        lines = [f"throughput on {c.describe()}; {self.answers_per_step} answers a step of up to "
                 f"{self.answer_tokens:,} tokens ({self.new_tokens:,} generated)",
                 f"  generation  one server ({self.gpus_per_server} GPU): {self.gen_tokens_per_s:,.0f} tokens/s "
                 f"with {self.batch} answers decoding",
                 f"  training    one GPU: {self.train_tokens_per_s:,.0f} tokens/s at MFU {self.mfu:.1%} "
                 f"({self.mfu_source})"]
        for label, split in (("balanced", (self.server_gpus, self.trainer_gpus)), ("configured", self.configured)):
            if split is None or split[0] is None:
                continue
            s, t = split
            lines.append(f"  {label:<11} {s} server GPUs ({s // self.gpus_per_server} servers) + {t} trainer GPUs: "
                         f"generation {self.gen_s(s):.1f} s, training {self.train_s(t):.1f} s a step; "
                         f"speed-up bound at eta={self.eta}: {self.speedup_bound(s, t):.2f}x")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def plan_throughput(cfg: ArealiteConfig, cluster: Cluster, hf_config: dict | None = None,
                    mfu: float | None = None) -> ThroughputPlan:
    """The throughput plan of ``cfg`` on ``cluster`` (``mfu``: the trainer's, default
    `MEASURED_MFU`)."""
    hf_config = hf_config if hf_config is not None else read_model_config(cfg)
    if mfu is not None and not 0 < mfu <= 1:
        raise ValueError(f"--mfu {mfu} must be in (0, 1]")
    size = model_size(hf_config)
    server = server_memory(cfg, cluster.spec, hf_config)
    tp = gpus_per_server(cfg) if cfg.launch.server_backend != "sim" else cfg.server.sim.gpus_per_server
    batch = min(server.concurrent_answers, cfg.rollout.max_inflight_per_server)
    spec = server_spec(cfg, cluster, size, tp)
    plan = ThroughputPlan(
        cluster=cluster, gpus_per_server=tp, batch=batch, spec=spec,
        gen_tokens_per_s=_server_tokens_per_s(cfg, spec, batch),
        train_tokens_per_s=0.0, mfu=mfu or MEASURED_MFU, mfu_source="given" if mfu else _MFU_SOURCE,
        answers_per_step=cfg.rollout.consumer_batch_size * cfg.generation.n_samples,
        answer_tokens=answer_tokens(cfg), new_tokens=cfg.generation.max_new_tokens,
        eta=cfg.rollout.max_head_offpolicyness)
    flops, passes = _train_flops_per_token(cfg, size, plan.answer_tokens)
    plan.train_tokens_per_s = plan.mfu * cluster.spec.peak_tflops * 1e12 / flops
    plan.notes.append(f"training FLOPs per token: 6 x {size.matmul_params / 1e9:.2f}B matmul parameters + causal "
                      f"attention, {passes}")
    if batch < 1:
        plan.notes.append("a server cannot hold one answer (see the server's memory): no split")
        return plan
    plan.server_gpus, plan.trainer_gpus = _balanced_split(cfg, cluster.n_gpus, tp, plan, hf_config)
    own = cfg.launch.n_servers * tp, cfg.launch.n_trainer_procs
    if own[0] >= tp and own[1] >= 1 and sum(own) <= cluster.n_gpus:
        plan.configured = own
    if cfg.launch.server_backend == "embedded":
        plan.notes.append("generation is priced with SGLang-like efficiency (server.sim's mbu, mfu_decode, "
                          "step overhead); the embedded server's padded HF forward is slower")
    plan.notes.append("answers all of the configured maximum length; the client's own limit "
                      "(launch.n_trainer_procs x rollout.max_concurrent_rollouts episodes) is not applied")
    return plan


def server_spec(cfg: ArealiteConfig, cluster: Cluster, size: ModelSize, tp: int) -> SimSpec:
    """One server of ``cfg`` on ``cluster`` as the simulator's cost model prices it: the card, the
    run's own model shape, ``server.sim``'s efficiencies and weight bandwidth (answer lengths are
    `arealite.plan.attainable`'s, which alone uses them)."""
    o = cfg.server.sim
    return SimSpec(gpu_shape=cluster.spec, gpus_per_server=tp, mem_fraction=1.0, mbu=o.mbu,
                   mfu_decode=o.mfu_decode, mfu_prefill=o.mfu_prefill, step_overhead_ms=o.step_overhead_ms,
                   weight_gbps=o.weight_gbps,
                   model_shape=ModelSpec(params_b=size.params / 1e9, n_layers=size.layers,
                                         kv_heads=size.kv_heads, head_dim=size.head_dim))


def _server_tokens_per_s(cfg: ArealiteConfig, spec: SimSpec, batch: int) -> float:
    """Generated tokens/s of one server: ``batch`` answers prefilled together (a group's samples
    share their prompt in the prefix cache), then decoded to ``max_new_tokens``."""
    if batch < 1:
        return 0.0
    prompt, new = cfg.data.max_prompt_len or 0, cfg.generation.max_new_tokens
    prefill = spec.prefill_s(max(1, batch * prompt // cfg.generation.n_samples)) if prompt else 0.0
    return batch * new / (prefill + spec.steps_s(new, batch, batch * prompt))


def _train_flops_per_token(cfg: ArealiteConfig, size: ModelSize, length: int) -> tuple[float, str]:
    """FLOPs per trained token (bench_mfu's count: ``6 x matmul parameters`` plus causal attention
    ``6 x layers x heads x head_dim x length``), with a forward (a third) for each extra pass."""
    train = 6 * size.matmul_params + 6 * size.layers * size.attn_heads * size.head_dim * length
    extra = []
    if cfg.algorithm.use_decoupled_loss:
        extra.append("recomputed proximal log-probs")
    if cfg.algorithm.kl_coef > 0:
        extra.append("the reference model's forward")
    what = "plus a forward for " + " and ".join(extra) if extra else "one forward and backward"
    return train * (1 + len(extra) / 3), what


def _balanced_split(cfg: ArealiteConfig, n_gpus: int, tp: int, plan: ThroughputPlan,
                    hf_config: dict) -> tuple[int | None, int | None]:
    """Server GPUs (a multiple of ``tp``) and trainer GPUs (>= 1) that make the slower side of a
    step the fastest; trainer counts the layout and ``rollout.consumer_batch_size`` can split
    first."""
    splits = [(s, n_gpus - s) for s in range(tp, n_gpus, tp)]
    if not splits:
        plan.notes.append(f"{n_gpus} GPU(s) cannot hold a server of {tp} GPU(s) and a trainer GPU")
        return None, None

    def trainable(t: int) -> bool:
        layout = ParallelLayout.of(cfg.actor, t)
        return (cfg.rollout.consumer_batch_size % t == 0
                and not layout.problems("actor", lora=cfg.actor.lora is not None, hf_config=hf_config))

    usable = [st for st in splits if trainable(st[1])]
    if not usable:
        plan.notes.append("no trainer GPU count fits the actor's layout and rollout.consumer_batch_size; "
                          "the split below ignores them")
        usable = splits
    return min(usable, key=lambda st: (max(plan.gen_s(st[0]), plan.train_s(st[1])), st[0]))
