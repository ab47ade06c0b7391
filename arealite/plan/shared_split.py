"""The memory split of `launch.placement: shared`: trainer and server resident on one GPU.

The planner predicts each alone (`run_plan.plan_run`); here the two are added up on the card.
An SGLang server takes ``server.sglang.mem_fraction_static`` of the card whatever it needs, so
its share is that fraction; an embedded server's is its predicted total. A split that does not
fit names the fraction that would (the card less the trainer's need) or more GPUs.
"""

from __future__ import annotations

from arealite.config.problems import ConfigProblem
from arealite.config.schema import ArealiteConfig
from arealite.plan.breakdown import GIB
from arealite.plan.gpus import parse_gpus
from arealite.plan.run_plan import model_config, plan_run

__all__ = ["shared_split_problems"]


def shared_split_problems(cfg: ArealiteConfig) -> list[ConfigProblem]:
    """With `launch.placement: shared` and `launch.gpus` set, the trainer rank's and the server's
    predicted memory together fit one card (`launch.memory_check` as for the other fit checks)."""
    if cfg.launch.placement != "shared" or not cfg.launch.gpus or cfg.launch.memory_check == "off":
        return []
    if model_config(cfg.actor.model_path) is None:
        return []
    try:
        cluster = parse_gpus(cfg.launch.gpus, memory_gib=cfg.launch.gpu_memory_gib)
    except ValueError:
        return []  # reported by the run plan's own check, naming launch.gpus
    plan = plan_run(cfg, cluster)
    cap = plan.capacity
    trainer = sum(b.total for b in plan.trainers.values())
    if cfg.launch.server_backend == "sglang":
        field, value = "server.sglang.mem_fraction_static", cfg.server.sglang.mem_fraction_static
        server = int(cap * value)
    else:
        field, value = "launch.placement", "shared"
        server = plan.server.breakdown.total if plan.server is not None else 0
    if trainer + server <= cap:
        return []
    room = (cap - trainer) / cap
    fix = (f"set server.sglang.mem_fraction_static <= {room:.2f} if the server still fits in it"
           if field.startswith("server.sglang") and room > 0 else
           "use launch.placement=colocated (time-shared: each gets the whole card in turn) or more GPUs")
    problem = ConfigProblem(field, (
        f"launch.placement=shared puts a trainer rank ({trainer / GIB:.1f} GiB predicted) and a server "
        f"({server / GIB:.1f} GiB) on one {cluster.name} of {cap / GIB:.3g} GiB: {fix} "
        "(python -m arealite.plan shows every part)"), value)
    if cfg.launch.memory_check == "warn":
        import logging

        logging.getLogger(__name__).warning("memory check: %s", problem.format())
        return []
    return [problem]
