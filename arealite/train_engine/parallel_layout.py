"""How a train engine's ranks divide the work: data parallel, times sequence or tensor parallel.

``world = dp x sp`` or ``world = dp x tp``. The ``sp`` (or ``tp``) ranks of one *model-parallel
group* compute the same packed micro-batches together: the engine gathers the rows its callers
hand to each rank of the group, so that a caller splits a batch over ranks the same way whatever
the layout (``arealite.train_engine.row_gather``). FSDP2 shards the parameters over all ranks
with sequence parallelism (the ``sp`` ranks hold different tokens, so their gradients add up),
and over the ``dp`` ranks of a data x tensor mesh with tensor parallelism (the ``tp`` ranks of a
group hold different slices of the same weights).

`layout_problems` says what makes a layout impossible, naming the fields, before anything starts
(`arealite.check` runs it on a run's config; the engine again on the model it loads).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from arealite.config.problems import ConfigProblem
from arealite.config.schema import ArealiteConfig, TrainEngineConfig
from arealite.train_engine.expert_parallel import expert_parallel_problems
from arealite.train_engine.tensor_parallel import tensor_parallel_problems

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Meshes", "ParallelLayout", "build_meshes", "layout_error", "layout_problems", "run_layout_problems"]


@dataclass(frozen=True)
class ParallelLayout:
    """``world`` ranks as ``dp`` data-parallel groups of ``sp x tp`` ranks (one of them 1)."""

    world: int
    sp: int = 1
    tp: int = 1
    ep: int = 1
    """Expert-parallel ranks (``world = edp x ep``); the data stays data-parallel over all ranks."""

    @property
    def group_size(self) -> int:
        """Ranks that compute one micro-batch together (1: plain data parallelism)."""
        return self.sp * self.tp

    @property
    def dp(self) -> int:
        return self.world // self.group_size


@dataclass
class Meshes:
    """The device meshes and groups of a layout on this rank."""

    fsdp: DeviceMesh
    """What FSDP2 shards the parameters over."""
    tp: DeviceMesh | None = None
    """The tensor-parallel mesh (``tp > 1``)."""
    group: dist.ProcessGroup | None = None
    """The model-parallel group (``sp`` or ``tp`` ranks; None when both are 1)."""
    ep: DeviceMesh | None = None
    """The expert-parallel mesh (``ep > 1``): the ranks that split one copy of the experts."""
    ep_replicas: dist.ProcessGroup | None = None
    """The ranks holding the same experts as this one (``ep > 1``)."""


def layout_problems(section: str, sp: int, tp: int, world: int, *, lora: bool = False,
                    hf_config: dict | None = None, ep: int = 1) -> list[ConfigProblem]:
    """What makes ``{section}.sp_size=sp``, ``{section}.tp_size=tp`` (``{section}.ep_size=ep``)
    impossible on ``world`` ranks (with ``hf_config``, the model's config.json as a dict: for that
    model too)."""
    sp_field, tp_field = f"{section}.sp_size", f"{section}.tp_size"
    field, value = (tp_field, tp) if tp > 1 else (sp_field, sp)
    problems = expert_parallel_problems(section, ep, world, sp=sp, tp=tp, lora=lora, hf_config=hf_config)
    if sp > 1 and tp > 1:
        problems.append(ConfigProblem(sp_field, f"sequence and tensor parallelism are not combined "
                                      f"({tp_field}={tp}); set one of them to 1", sp))
    if world % (sp * tp):
        problems.append(ConfigProblem(field, f"{sp_field} x {tp_field} = {sp * tp} does not divide the {world} "
                                      "trainer ranks (launch.n_trainer_procs); make the world size a multiple "
                                      "of it", value))
    if tp > 1 and lora:
        problems.append(ConfigProblem(tp_field, f"LoRA adapters ({section}.lora) are not split over tensor-"
                                      f"parallel ranks; train LoRA with {tp_field}=1 (FSDP2 alone, or "
                                      f"{sp_field})", tp))
    if hf_config is None:
        return problems
    if "vision_config" in hf_config and sp * tp > 1:
        problems.append(ConfigProblem(field, "a vision-language model trains with FSDP2 alone: sequence and "
                                      f"tensor parallelism do not split its images yet; set {sp_field}=1 and "
                                      f"{tp_field}=1", value))
    if hf_config.get("use_sliding_window") and sp * tp > 1:
        problems.append(ConfigProblem(field, "the model uses sliding-window attention, which the packed "
                                      f"attention implementations do not run; set {sp_field}=1 and "
                                      f"{tp_field}=1", value))
    heads = hf_config.get("num_attention_heads")
    if sp > 1 and isinstance(heads, int) and heads % sp:
        problems.append(ConfigProblem(sp_field, f"does not divide the model's num_attention_heads={heads}: "
                                      "Ulysses splits the heads over the sequence-parallel ranks; pick a "
                                      "divisor", sp))
    if tp > 1:
        problems += tensor_parallel_problems(hf_config, tp, tp_field)
    return problems


def _model_config(path: str | None) -> dict | None:
    """The config.json of a model directory as a dict, or None where there is none (yet)."""
    if not path:
        return None
    file = Path(path) / "config.json"
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return None


def _engine_problems(section: str, engine: TrainEngineConfig, world: int, model_path: str | None,
                     lora: bool = False) -> list[ConfigProblem]:
    if engine.sp_size == 1 and engine.tp_size == 1 and engine.ep_size == 1:
        return []
    return layout_problems(section, engine.sp_size, engine.tp_size, world, lora=lora,
                           hf_config=_model_config(model_path), ep=engine.ep_size)


def run_layout_problems(cfg: ArealiteConfig) -> list[ConfigProblem]:
    """`layout_problems` of the actor's and the critic's layouts on the run's trainer ranks
    (``launch.n_trainer_procs``), with their models' configs where they exist."""
    world = cfg.launch.n_trainer_procs
    problems = _engine_problems("actor", cfg.actor, world, cfg.actor.model_path, lora=cfg.actor.lora is not None)
    if cfg.critic.enabled:
        problems += _engine_problems("critic", cfg.critic, world, cfg.critic.model_path or cfg.actor.model_path)
    return problems


def build_meshes(layout: ParallelLayout, device_type: str) -> Meshes:
    """The meshes of ``layout`` (a collective: every rank calls it). Ranks ``[g * k, g * (k + 1))``
    form model-parallel group ``k`` (``g`` its size), so that a group sits on one node."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout.tp > 1:
        mesh = init_device_mesh(device_type, (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
        return Meshes(fsdp=mesh["dp"], tp=mesh["tp"], group=mesh["tp"].get_group())
    fsdp = init_device_mesh(device_type, (layout.world,), mesh_dim_names=("dp",))
    if layout.ep > 1:
        mesh = init_device_mesh(device_type, (layout.world // layout.ep, layout.ep), mesh_dim_names=("edp", "ep"))
        return Meshes(fsdp=fsdp, ep=mesh["ep"], ep_replicas=mesh["edp"].get_group())
    if layout.sp > 1:
        mesh = init_device_mesh(device_type, (layout.dp, layout.sp), mesh_dim_names=("dp", "sp"))
        return Meshes(fsdp=fsdp, group=mesh["sp"].get_group())
    return Meshes(fsdp=fsdp)


def layout_error(problems: list[ConfigProblem]) -> ValueError:
    """One error listing ``problems`` (an engine built in code, outside a checked config)."""
    return ValueError("; ".join(p.format() for p in problems))
