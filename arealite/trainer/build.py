"""Builders of the run's parts from config: data, train engines, critic, actor, rollout side.

Each returns an object typed by its contract (`arealite.api.contracts`); `RLTrainer`
wires them together. A second backend is one more branch here and one module. The
rollout side's own parts (inference client, workflows) are built by `arealite.rollout.build`,
in whichever process runs them.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from arealite.algo.actor import PPOActor
from arealite.api.contracts import RolloutSide, TrainEngine
from arealite.config.schema import ArealiteConfig
from arealite.data.dataset import StatefulDataLoader
from arealite.data.sources import load_prompt_sets
from arealite.data.validate import validate_datasets
from arealite.rollout.build import build_inference_client, build_local_rollout
from arealite.rollout.worker import RolloutWorker, WorkerSpec, runs_in_a_worker
from arealite.utils import accounting
from arealite.utils.json_types import JsonObject
from arealite.vision.dataset_checks import dataset_image_tokens
from arealite.vision.prompt import VisionPrompt
from arealite.workflow.base import RolloutWorkflow
from arealite.workflow.common import processor_for, render_vision_item

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from arealite.critic import Critic, WithCritic

logger = logging.getLogger("arealite.trainer")


def rank_and_world() -> tuple[int, int]:
    """This trainer process's rank and the number of ranks (torchrun's environment)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def load_data(cfg: ArealiteConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[list[JsonObject], list[JsonObject]]:
    """Training and held-out items, every bad prompt and image named before anything starts."""
    from arealite.workflow.registry import environment_prompt_sets

    train, held_out = load_prompt_sets(cfg, environment_prompt_sets)  # from where data.source says
    image_tokens = dataset_image_tokens(cfg, train, held_out)  # None: no images, text model
    validate_datasets(cfg, tokenizer, train, held_out, extra_tokens=image_tokens)
    return train, held_out


def probe_prompt(cfg: ArealiteConfig, tokenizer: PreTrainedTokenizerBase | None,
                 items: list[JsonObject]) -> list[int] | VisionPrompt | None:
    """The first training prompt's tokens: what the weight publisher's log-prob probe scores
    (with a vision-language model, rendered with its images as the workflows render it)."""
    prompt = items[0].get(cfg.data.prompt_key) if items else None
    if tokenizer is None or prompt is None:
        return None
    processor = processor_for(cfg.actor.model_path)
    if processor is not None:
        return render_vision_item(processor, items[0], cfg.data.prompt_key, cfg.data.image_key,
                                  cfg.data.apply_chat_template, cfg.data.max_image_pixels)
    if isinstance(prompt, list):  # chat messages, rendered as the workflows render them
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(str(prompt)))


def make_loader(cfg: ArealiteConfig, items: list[JsonObject], rank: int, world: int) -> accounting.EpochTagged:
    """This rank's share of every batch of prompts; items remember their epoch (accounting)."""
    loader = StatefulDataLoader(items, cfg.rollout.consumer_batch_size // world, shuffle=cfg.data.shuffle,
                                seed=cfg.experiment.seed, rank=rank, world_size=world)
    return accounting.EpochTagged(loader)


def build_train_engines(cfg: ArealiteConfig, total_steps: int) -> tuple[TrainEngine, TrainEngine | None]:
    """The actor's engine (joins the torchrun process group) and, with a KL term, a frozen
    reference engine (with LoRA: the actor's own weights with the adapters off)."""
    from arealite.train_engine.fsdp import FSDPEngine

    if cfg.actor.backend == "sim":
        return build_sim_engines(cfg)
    if cfg.actor.lora is not None:
        from arealite.lora import LoraFSDPEngine

        lora = LoraFSDPEngine(cfg.actor).initialize(total_steps=total_steps)
        actor, ref = lora, (lora.reference() if cfg.algorithm.kl_coef > 0 else None)
    else:
        actor = FSDPEngine(cfg.actor).initialize(total_steps=total_steps)
        ref = FSDPEngine(cfg.actor, frozen=True).initialize() if cfg.algorithm.kl_coef > 0 else None
    # MoE routing replay: the policy's and the reference's forwards route as the servers did.
    # (A LoRA run's reference is the actor's own engine with the adapters off.)
    for engine in (actor, ref):
        if isinstance(engine, FSDPEngine):
            engine.routing_replay = cfg.algorithm.routing_replay
    return actor, ref


def build_sim_engines(cfg: ArealiteConfig) -> tuple[TrainEngine, TrainEngine | None]:
    """`actor.backend: sim`: the simulated cluster's engine (docs/scale.md), and a frozen one
    as the reference with a KL term."""
    from arealite.sim.train_engine import SimTrainEngine

    if cfg.actor.lora is not None or cfg.critic.enabled:
        raise ValueError("actor.backend=sim simulates full fine-tuning of the actor only: "
                         "set actor.lora: null and critic.enabled: false")
    scale = cfg.server.sim.time_scale

    def engine(frozen: bool) -> TrainEngine:
        return SimTrainEngine(cfg.actor.sim, cfg.actor.model_path, scale, frozen=frozen).initialize()

    return engine(False), (engine(True) if cfg.algorithm.kl_coef > 0 else None)


def build_critic(cfg: ArealiteConfig, total_steps: int) -> Critic | None:
    """PPO's value model on its own engine (`critic.enabled`), or None."""
    if not cfg.critic.enabled:
        return None
    from arealite.critic import Critic, ValueEngine

    c = cfg.critic  # a train engine's config itself; its backbone is the actor's unless it names one
    engine_cfg = c.model_copy(update={"model_path": c.model_path or cfg.actor.model_path})
    engine = ValueEngine(engine_cfg).initialize(total_steps=total_steps)
    return Critic(engine, c.value_clip, cfg.algorithm.n_minibatches)


def checkpointed_engines(actor: TrainEngine, critic: Critic | None) -> TrainEngine | WithCritic:
    """What the checkpointer saves: the actor's engine, with the critic's beside it when there is one."""
    if critic is None:
        return actor
    from arealite.critic import WithCritic

    return WithCritic(actor, critic.engine)


def build_actor(cfg: ArealiteConfig, engine: TrainEngine, ref_engine: TrainEngine | None) -> PPOActor:
    """The PPO actor: log-probs with the rollout temperature, advantages, the policy loss."""
    temperature = cfg.actor.temperature or cfg.generation.temperature or 1.0
    return PPOActor(cfg.algorithm, engine, temperature=temperature, ref_engine=ref_engine,
                    max_new_tokens=cfg.generation.max_new_tokens)


def build_rollout(cfg: ArealiteConfig, tokenizer: PreTrainedTokenizerBase, loader: accounting.EpochTagged,
                  world: int, workflow: RolloutWorkflow | None,
                  eval_workflow: RolloutWorkflow | None) -> RolloutSide:
    """This rank's rollout side (`rollout.worker`): a child process, or this process.

    ``workflow`` None: built from ``rollout.workflow`` (and its greedy copy for evaluation);
    a given workflow without an ``eval_workflow`` also evaluates.
    """
    why_not = runs_in_a_worker(workflow, eval_workflow) if cfg.rollout.worker == "process" else None
    if why_not:
        logger.warning("the rollout runs in a thread of the trainer process (rollout.worker=thread): %s",
                       why_not)
    if cfg.rollout.worker == "thread" or why_not:
        return build_local_rollout(cfg, tokenizer, loader, world, workflow, eval_workflow)
    spec = WorkerSpec(cfg, world, loader, workflow, eval_workflow)
    return RolloutWorker(spec, admin_client=build_inference_client(cfg, tokenizer))
