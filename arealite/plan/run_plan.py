"""A whole run's plan: every trainer rank's and every server's memory against the card, the
throughput, and, for a layout that will not fit, the cheapest change that does.

`plan_run` assembles the parts (`trainer_memory`, `server_memory`, `throughput`); `RunPlan.problems`
turns what does not fit into `ConfigProblem`s naming the fields; `fit_problems` is the check
`python -m arealite.check` and the launchers run when ``launch.gpus`` names the cluster's GPUs.
A fix is found by planning again with one field changed, cheapest first (`TRAINER_FIXES`,
`SERVER_FIXES`), so a suggested fix is one the same model predicts to fit.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from arealite.config.problems import ConfigProblem
from arealite.config.schema import ArealiteConfig
from arealite.plan.attainable import AttainablePlan
from arealite.plan.breakdown import GIB, MemoryBreakdown
from arealite.plan.gpus import Cluster, parse_gpus
from arealite.plan.server_memory import ServerPlan, answer_tokens, server_memory
from arealite.plan.throughput import ThroughputPlan, plan_throughput
from arealite.plan.trainer_memory import trainer_rank_memory
from arealite.train_engine.parallel.layout import model_config

__all__ = ["RunPlan", "fit_problems", "model_config", "plan_run"]

logger = logging.getLogger(__name__)


@dataclass
class RunPlan:
    """What `plan_run` predicts for one run on one cluster."""

    cfg: ArealiteConfig
    cluster: Cluster
    trainers: dict[str, MemoryBreakdown] = field(default_factory=dict)
    """The largest rank of each train engine (``actor``, and ``critic`` when enabled)."""
    server: ServerPlan | None = None
    throughput: ThroughputPlan | None = None
    attainable: AttainablePlan | None = None
    """Set by `python -m arealite.plan` (`plan_attainable`): the speed-up the staleness bound allows."""

    @property
    def capacity(self) -> int:
        """One card's memory in bytes."""
        return self.cluster.memory_bytes

    def over(self) -> list[tuple[str, MemoryBreakdown]]:
        """The processes predicted not to fit: ``(section, breakdown)``."""
        out = [(s, b) for s, b in self.trainers.items() if b.total > self.capacity]
        if self.server is not None and not self.server.fits:
            out.append(("server", self.server.breakdown))
        return out

    def table(self) -> str:
        parts = [f"cluster: {self.cluster.describe()}"]
        for breakdown in self.trainers.values():
            parts.append("\n".join([breakdown.table(self.capacity)] + [f"  note: {n}" for n in breakdown.notes]))
        if self.server is not None:
            parts.append(self.server.table())
        if self.throughput is not None:
            parts.append(self.throughput.table())
        if self.attainable is not None:
            parts.append(self.attainable.table())
        return "\n\n".join(parts)


def plan_run(cfg: ArealiteConfig, cluster: Cluster, *, mfu: float | None = None, device: str = "cuda") -> RunPlan:
    """Predict ``cfg``'s memory and throughput on ``cluster`` (the models' config.json files must exist)."""
    hf = model_config(cfg.actor.model_path)
    if hf is None:
        raise ValueError(f"actor.model_path={cfg.actor.model_path!r} has no config.json to plan from")
    plan = RunPlan(cfg, cluster)
    plan.trainers["actor"] = trainer_rank_memory(cfg, "actor", hf_config=hf, device=device)
    if cfg.critic.enabled:
        critic_hf = model_config(cfg.critic.model_path) or hf
        plan.trainers["critic"] = trainer_rank_memory(cfg, "critic", hf_config=critic_hf, device=device)
    server_hf = model_config(cfg.server.model_path) or hf
    plan.server = server_memory(cfg, cluster.spec, server_hf)
    plan.throughput = plan_throughput(cfg, cluster, hf, mfu=mfu)
    return plan


#: Changes to a train engine that lower its memory, cheapest first: each takes the config and the
#: engine's section and yields ``(field, new value)`` candidates.
Fix = Callable[[ArealiteConfig, str], Iterator[tuple[str, object]]]


def _smaller_micro_batches(cfg: ArealiteConfig, section: str) -> Iterator[tuple[str, object]]:
    engine = getattr(cfg, section)
    floor = answer_tokens(cfg)  # a row is never split across micro-batches
    budget = engine.mb_max_tokens // 2
    while budget >= floor:
        yield f"{section}.mb_max_tokens", budget
        budget //= 2


def _checkpointing(cfg: ArealiteConfig, section: str) -> Iterator[tuple[str, object]]:
    if not getattr(cfg, section).gradient_checkpointing:
        yield f"{section}.gradient_checkpointing", True


def _more_sequence_parallelism(cfg: ArealiteConfig, section: str) -> Iterator[tuple[str, object]]:
    engine, world = getattr(cfg, section), cfg.launch.n_trainer_procs
    sp = engine.sp_size * 2
    while world % (engine.dp_replicate * sp * engine.tp_size) == 0:
        yield f"{section}.sp_size", sp
        sp *= 2


def _offload(cfg: ArealiteConfig, section: str) -> Iterator[tuple[str, object]]:
    if not getattr(cfg, section).cpu_offload:
        yield f"{section}.cpu_offload", True


TRAINER_FIXES: tuple[Fix, ...] = (_smaller_micro_batches, _checkpointing, _more_sequence_parallelism, _offload)


def _with(cfg: ArealiteConfig, path: str, value: object) -> ArealiteConfig:
    """A copy of ``cfg`` with the dotted field ``path`` set to ``value``."""
    new = cfg.model_copy(deep=True)
    *parents, leaf = path.split(".")
    node = new
    for name in parents:
        node = getattr(node, name)
    setattr(node, leaf, value)
    return new


def _trainer_fix(plan: RunPlan, section: str, device: str) -> str | None:
    """The cheapest single change predicted to fit ``section``'s ranks on the card, as ``field=value``."""
    hf = model_config(getattr(plan.cfg, section).model_path or plan.cfg.actor.model_path)
    for fix in TRAINER_FIXES:
        for path, value in fix(plan.cfg, section):
            changed = _with(plan.cfg, path, value)
            try:
                total = trainer_rank_memory(changed, section, hf_config=hf, device=device).total
            except ValueError:  # a layout the model cannot take
                continue
            if total <= plan.capacity:
                return f"{path}={json.dumps(value)} (predicted {total / GIB:.1f} GiB)"
    return None


def _server_fix(plan: RunPlan) -> str | None:
    """The cheapest change that lets a server run one answer of the configured length."""
    cfg = plan.cfg
    hf = model_config(cfg.server.model_path) or model_config(cfg.actor.model_path)
    if cfg.launch.server_backend == "sglang":
        fraction = cfg.server.sglang.mem_fraction_static
        candidates = [("server.sglang.mem_fraction_static", f) for f in (0.85, 0.9) if f > fraction]
        candidates += [("server.sglang.tp_size", cfg.server.sglang.tp_size * k) for k in (2, 4, 8)]
    else:
        rows = cfg.server.max_batch_size
        candidates = [("server.max_batch_size", rows // k) for k in (2, 4, 8, 16) if rows // k >= 1]
    for path, value in candidates:
        if server_memory(_with(cfg, path, value), plan.cluster.spec, hf).fits:
            return f"{path}={json.dumps(value)}"
    return None


def _value(cfg: ArealiteConfig, path: str) -> object:
    node: object = cfg
    for name in path.split("."):
        node = getattr(node, name)
    return node


def plan_problems(plan: RunPlan, device: str = "cuda") -> list[ConfigProblem]:
    """One `ConfigProblem` per process predicted not to fit, naming the fields and the cheapest fix."""
    problems = []
    cap = plan.capacity
    for section, breakdown in plan.over():
        if section == "server":
            fix = _server_fix(plan)
            message = f"a server on a {plan.cluster.name} of {cap / GIB:.3g} GiB: " + "; ".join(plan.server.problems)
            field_path = ("server.sglang.mem_fraction_static" if plan.cfg.launch.server_backend == "sglang"
                          else "server.max_batch_size")
        else:
            fix = _trainer_fix(plan, section, device)
            largest = max(breakdown.parts, key=breakdown.parts.get)
            message = (f"a trainer rank is predicted to need {breakdown.total / GIB:.1f} GiB on a "
                       f"{plan.cluster.name} of {cap / GIB:.3g} GiB (largest part: {largest}, "
                       f"{breakdown.parts[largest] / GIB:.1f} GiB)")
            field_path = f"{section}.mb_max_tokens"
        message += f"; cheapest fix that fits: {fix}" if fix else "; no single change fits: use more or larger GPUs"
        problems.append(ConfigProblem(field_path, message + " (python -m arealite.plan shows every part)",
                                      _value(plan.cfg, field_path)))
    return problems


def fit_problems(cfg: ArealiteConfig) -> list[ConfigProblem]:
    """The run check: with ``launch.gpus`` set and ``launch.memory_check`` not ``off``, the problems
    of `plan_problems` (``warn``: logged, not raised). Nothing when the model's config.json is absent."""
    if not cfg.launch.gpus or cfg.launch.memory_check == "off":
        return []
    if model_config(cfg.actor.model_path) is None:
        return []
    try:
        cluster = parse_gpus(cfg.launch.gpus, memory_gib=cfg.launch.gpu_memory_gib)
    except ValueError as e:
        return [ConfigProblem("launch.gpus", str(e), cfg.launch.gpus)]
    problems = plan_problems(plan_run(cfg, cluster))
    if cfg.launch.memory_check == "warn":
        for p in problems:
            logger.warning("memory check: %s", p.format())
        return []
    return problems
