"""What `launch.placement` asks of the rest of a config (docs/placement.md).

`colocated` time-shares every GPU: the servers sleep while the trainer trains, so no rollout
can run ahead of the weights (η = 0); each trainer rank's GPU hosts one server share.
`shared` keeps both resident on the same GPUs: the same one-share-per-GPU layout, with the
memory split checked by the planner (`arealite.plan.placement`) when `launch.gpus` is set.
"""

from __future__ import annotations

from arealite.config.problems import ConfigProblem
from arealite.config.schema import ArealiteConfig

__all__ = ["check_placement"]


def check_placement(cfg: ArealiteConfig) -> list[ConfigProblem]:
    """`launch.placement: colocated` runs synchronously (`rollout.max_head_offpolicyness` 0), on servers
    that can release their memory, without LoRA; colocated and shared SGLang servers cover the trainer's
    GPUs one share per rank (`launch.n_servers` x `server.sglang.tp_size` = `launch.n_trainer_procs`)."""
    placement, launch = cfg.launch.placement, cfg.launch
    if placement == "disaggregated":
        return []
    out = []
    if placement == "colocated":
        eta = cfg.rollout.max_head_offpolicyness
        if eta > 0:
            out.append(ConfigProblem(
                "rollout.max_head_offpolicyness", "must be 0 with launch.placement=colocated: the servers "
                "sleep while the trainer trains, so no rollout can run ahead of the weights (synchronous RL); "
                "set it to 0, or use launch.placement=shared to overlap generation and training", eta))
        if launch.server_backend == "sim":
            out.append(ConfigProblem(
                "launch.server_backend", "= sim has no memory to release: launch.placement=colocated needs "
                "the embedded server or SGLang", "sim"))
        if cfg.actor.lora is not None:
            out.append(ConfigProblem(
                "actor.lora", "is set, but launch.placement=colocated pushes whole weights by tensor after "
                "each wake-up: train LoRA with launch.placement=disaggregated or shared", "set"))
    if launch.server_backend == "sglang" and launch.n_servers:
        gpus = launch.n_servers * cfg.server.sglang.tp_size
        if gpus != launch.n_trainer_procs:
            out.append(ConfigProblem(
                "launch.n_servers", f"x server.sglang.tp_size = {gpus} server GPU(s), but launch.placement="
                f"{placement} puts one server share on each of the launch.n_trainer_procs = "
                f"{launch.n_trainer_procs} trainer GPU(s): make them equal", launch.n_servers))
    return out
