"""How a train engine's ranks divide the work: one object owns every degree of parallelism.

``world = dp_replicate x dp_shard x sp x tp`` (outermost first: the ``tp`` ranks of a group are
neighbours, so that tensor parallelism stays within a node, then sequence parallelism, then the
data ranks). Expert parallelism borrows its ``ep`` ranks from the ``dp_shard x sp`` ranks (a
mixture-of-experts block's tokens are independent of each other, whichever rank holds them).

- ``dp_replicate x dp_shard`` data-parallel ranks compute different rows. FSDP2 shards the
  parameters over ``dp_shard x sp`` ranks and replicates them over ``dp_replicate`` (hybrid
  sharding: a node's ranks all-gather and reduce-scatter among themselves; only the gradient's
  all-reduce crosses nodes).
- The ``sp x tp`` ranks of a *model-parallel group* compute the same packed micro-batches: the
  engine gathers the rows its callers hand each of them (`row_gather`), so a caller splits a
  batch over ranks the same way whatever the layout. Within the group the ``tp`` ranks hold
  different slices of each layer's projections (`tensor`), and the ``sp`` ranks different
  tokens (`sequence`: Ulysses over the heads each tensor-parallel rank holds).
- The ``ep`` ranks of an expert group hold different experts of every MoE layer (`experts`).

`ParallelLayout.problems` says what makes a layout impossible, naming the fields, before
anything starts: `arealite.check` and the launchers run it on a run's config
(`run_layout_problems`), the engine again on the model it loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from arealite.config.problems import ConfigProblem
from arealite.config.schema import ArealiteConfig, TrainEngineConfig
from arealite.train_engine.parallel.experts import expert_parallel_problems
from arealite.train_engine.parallel.tensor import tensor_parallel_problems

__all__ = ["ParallelLayout", "engine_layout_problems", "layout_error", "model_config", "run_layout_problems"]


@dataclass(frozen=True)
class ParallelLayout:
    """``world`` ranks as ``dp_replicate x dp_shard x sp x tp``, ``ep`` of the ``dp_shard x sp``
    ranks splitting the experts (``dp_shard`` is what is left of ``world``)."""

    world: int
    dp_replicate: int = 1
    sp: int = 1
    tp: int = 1
    ep: int = 1

    @classmethod
    def of(cls, config: TrainEngineConfig, world: int) -> ParallelLayout:
        """The layout ``config`` (an engine section) asks for on ``world`` ranks."""
        return cls(world, dp_replicate=config.dp_replicate, sp=config.sp_size, tp=config.tp_size, ep=config.ep_size)

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks within one replica (FSDP2 shards over them, times ``sp``)."""
        return max(self.world // (self.dp_replicate * self.sp * self.tp), 1)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: groups computing different rows."""
        return self.dp_replicate * self.dp_shard

    @property
    def group_size(self) -> int:
        """Ranks that compute one micro-batch together (1: plain data parallelism)."""
        return self.sp * self.tp

    @property
    def fsdp_size(self) -> int:
        """Ranks whose gradients FSDP2 averages (``dp x sp``): the engine scales the loss by it."""
        return self.dp * self.sp

    @property
    def trivial(self) -> bool:
        """Plain data parallelism, every parameter sharded over every rank."""
        return self.dp_replicate == self.sp == self.tp == self.ep == 1

    def describe(self) -> str:
        parts = [f"dp_replicate={self.dp_replicate}", f"dp_shard={self.dp_shard}", f"sp={self.sp}",
                 f"tp={self.tp}", f"ep={self.ep}"]
        return " x ".join(parts[:4]) + f" ({parts[4]})"

    def problems(self, section: str, *, lora: bool = False, hf_config: dict | None = None) -> list[ConfigProblem]:
        """What makes this layout impossible for ``{section}`` (with ``hf_config``, the model's
        config.json as a dict: for that model too; ``lora``: the model carries LoRA adapters)."""
        problems = self._rank_problems(section)
        problems += expert_parallel_problems(section, self.ep, self.dp_shard * self.sp, lora=lora, hf_config=hf_config)
        tp_field, sp_field = f"{section}.tp_size", f"{section}.sp_size"
        if self.tp > 1 and lora:
            problems.append(ConfigProblem(tp_field, f"LoRA adapters ({section}.lora) are not split over tensor-"
                                          f"parallel ranks; train LoRA with {tp_field}=1 (FSDP2 alone, or "
                                          f"{sp_field})", self.tp))
        if hf_config is None:
            return problems
        if "vision_config" in hf_config and self.tp > 1:
            problems.append(ConfigProblem(tp_field, "a vision-language model's layers are not split by tensor "
                                          f"parallelism; set {tp_field}=1 and split long contexts with "
                                          f"{sp_field}", self.tp))
        text = hf_config.get("text_config") or hf_config
        heads = text.get("num_attention_heads")
        if self.sp > 1 and isinstance(heads, int) and heads % (self.sp * self.tp):
            problems.append(ConfigProblem(sp_field, f"{sp_field} x {tp_field} = {self.sp * self.tp} does not divide "
                                          f"the model's num_attention_heads={heads}: tensor parallelism splits the "
                                          "heads, then Ulysses splits each rank's heads over the sequence-parallel "
                                          "ranks; pick divisors", self.sp))
        if self.tp > 1:
            problems += tensor_parallel_problems(text, self.tp, tp_field)
        return problems

    def _rank_problems(self, section: str) -> list[ConfigProblem]:
        """The degrees against the number of ranks."""
        inner = self.dp_replicate * self.sp * self.tp
        if self.world % inner == 0:
            return []
        names = [(f"{section}.dp_replicate", self.dp_replicate), (f"{section}.sp_size", self.sp),
                 (f"{section}.tp_size", self.tp)]
        field, value = max(names, key=lambda nv: nv[1])
        product = " x ".join(f"{n}={v}" for n, v in names)
        return [ConfigProblem(field, f"{product} = {inner} does not divide the {self.world} trainer ranks "
                              "(launch.n_trainer_procs); make the world size a multiple of it", value)]


def layout_error(problems: list[ConfigProblem]) -> ValueError:
    """One error listing ``problems`` (an engine built in code, outside a checked config)."""
    return ValueError("; ".join(p.format() for p in problems))


def model_config(path: str | None) -> dict | None:
    """The config.json of a model directory as a dict, or None where there is none (yet)."""
    if not path:
        return None
    file = Path(path) / "config.json"
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return None


def engine_layout_problems(section: str, config: TrainEngineConfig, world: int, *, lora: bool = False,
                           hf_config: dict | None = None) -> list[ConfigProblem]:
    """The problems of the layout an engine section asks for on ``world`` ranks, and of the
    settings the layout constrains."""
    layout = ParallelLayout.of(config, world)
    problems = [] if layout.trivial else layout.problems(section, lora=lora, hf_config=hf_config)
    split = [f"{section}.{name}=1" for name, n in (("sp_size", layout.sp), ("tp_size", layout.tp)) if n > 1]
    if split and config.router_aux_loss_coef > 0:
        problems.append(ConfigProblem(f"{section}.router_aux_loss_coef", "the routers' load-balancing loss is "
                                      "computed per forward, and under sequence parallelism (or tensor parallelism, "
                                      "whose ranks each route a share of a MoE block's tokens) a router sees a part "
                                      f"of the micro-batch's tokens; set it to 0 or {' and '.join(split)}",
                                      config.router_aux_loss_coef))
    return problems


def run_layout_problems(cfg: ArealiteConfig) -> list[ConfigProblem]:
    """The problems of the actor's and the critic's layouts on the run's trainer ranks
    (``launch.n_trainer_procs``), with their models' configs where they exist."""
    world = cfg.launch.n_trainer_procs
    engines = [("actor", cfg.actor, cfg.actor.model_path, cfg.actor.lora is not None)]
    if cfg.critic.enabled:
        engines.append(("critic", cfg.critic, cfg.critic.model_path or cfg.actor.model_path, False))
    problems: list[ConfigProblem] = []
    for section, engine, path, lora in engines:
        problems += engine_layout_problems(section, engine, world, lora=lora, hf_config=model_config(path))
    return problems
