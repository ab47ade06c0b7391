"""Builders of the run's parts from config: data, train engines, actor, inference client.

Each returns an object typed by its contract (`arealite.api.contracts`); `RLTrainer`
wires them together. A second backend is one more branch here and one module.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any


from arealite.algo.actor import PPOActor
from arealite.api.contracts import InferenceClient, RolloutSide, TrainEngine
from arealite.config.schema import ArealiteConfig
from arealite.data.dataset import StatefulDataLoader, load_items
from arealite.data.validate import validate_datasets
from arealite.utils import accounting
from arealite.utils.run import server_addrs, server_api_key
from arealite.utils.tokenizer import vocab_bound
from arealite.workflow.base import RolloutWorkflow
from arealite.workflow.registry import build_workflow, samples_at_eval

if TYPE_CHECKING:
    from arealite.critic import Critic

logger = logging.getLogger("arealite.trainer")


def rank_and_world() -> tuple[int, int]:
    """This trainer process's rank and the number of ranks (torchrun's environment)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def load_data(cfg: ArealiteConfig, tokenizer: Any) -> tuple[list[dict], list[dict]]:
    """Training and held-out items, every bad prompt named before anything starts."""
    d = cfg.data
    train = load_items(d.train_path, d.prompt_key, d.answer_key)
    held_out = load_items(d.eval_path, d.prompt_key, d.answer_key) if d.eval_path else []
    held_out = held_out[: cfg.evaluation.max_prompts or len(held_out)]
    validate_datasets(cfg, tokenizer, train, held_out)
    return train, held_out


def probe_prompt(cfg: ArealiteConfig, tokenizer: Any, items: list[dict]) -> list[int] | None:
    """The first training prompt's tokens: what the weight publisher's log-prob probe scores."""
    prompt = items[0].get(cfg.data.prompt_key) if items else None
    if tokenizer is None or prompt is None:
        return None
    if isinstance(prompt, list):  # chat messages
        return list(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True))
    return list(tokenizer.encode(str(prompt)))


def make_loader(cfg: ArealiteConfig, items: list[dict], rank: int, world: int) -> accounting.EpochTagged:
    """This rank's share of every batch of prompts; items remember their epoch (accounting)."""
    loader = StatefulDataLoader(items, cfg.rollout.consumer_batch_size // world, shuffle=cfg.data.shuffle,
                                seed=cfg.experiment.seed, rank=rank, world_size=world)
    return accounting.EpochTagged(loader)


def build_train_engines(cfg: ArealiteConfig, total_steps: int) -> tuple[TrainEngine, TrainEngine | None]:
    """The actor's engine (joins the torchrun process group) and, with a KL term, a frozen
    reference engine (with LoRA: the actor's own weights with the adapters off)."""
    from arealite.train_engine.fsdp import FSDPEngine

    if cfg.actor.lora is not None:
        from arealite.lora import LoraFSDPEngine

        lora = LoraFSDPEngine(cfg.actor).initialize(total_steps=total_steps)
        return lora, (lora.reference() if cfg.algorithm.kl_coef > 0 else None)
    actor = FSDPEngine(cfg.actor).initialize(total_steps=total_steps)
    ref = FSDPEngine(cfg.actor, frozen=True).initialize() if cfg.algorithm.kl_coef > 0 else None
    return actor, ref


def build_critic(cfg: ArealiteConfig, total_steps: int) -> "Critic | None":
    """PPO's value model on its own engine (`critic.enabled`), or None."""
    if not cfg.critic.enabled:
        return None
    from arealite.config.schema import ActorConfig
    from arealite.critic import Critic, ValueEngine

    c = cfg.critic
    engine_cfg = ActorConfig(model_path=c.model_path or cfg.actor.model_path, dtype=c.dtype, optimizer=c.optimizer,
                             mb_max_tokens=c.mb_max_tokens, gradient_checkpointing=c.gradient_checkpointing)
    engine = ValueEngine(engine_cfg).initialize(total_steps=total_steps)
    return Critic(engine, c.value_clip, cfg.algorithm.n_minibatches)


def checkpointed_engines(actor: TrainEngine, critic: "Critic | None") -> Any:
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


def build_inference_client(cfg: ArealiteConfig, tokenizer: Any) -> InferenceClient:
    """The inference client of `launch.server_backend`'s servers (`arealite.inference_client.backends`)."""
    from arealite.inference_client.backends import client_class

    return client_class(cfg.launch.server_backend)(
        server_addrs(cfg), cfg.rollout, api_key=server_api_key(cfg), eos_token_ids=[tokenizer.eos_token_id],
        vocab_size=vocab_bound(cfg.actor.model_path, tokenizer),
        lora_adapter=cfg.actor.lora.served_name if cfg.actor.lora is not None else None)


def build_rollout(cfg: ArealiteConfig, tokenizer: Any, loader: Any, world: int,
                  workflow: RolloutWorkflow | None, eval_workflow: RolloutWorkflow | None) -> RolloutSide:
    """This rank's rollout side (`rollout.worker`): a child process, or this process.

    ``workflow`` None: built from ``rollout.workflow`` (and its greedy copy for evaluation);
    a given workflow without an ``eval_workflow`` also evaluates.
    """
    from arealite.rollout.worker import RolloutWorker, WorkerSpec, runs_in_a_worker

    why_not = runs_in_a_worker(workflow, eval_workflow) if cfg.rollout.worker == "process" else None
    if why_not:
        logger.warning("the rollout runs in a thread of the trainer process (rollout.worker=thread): %s",
                       why_not)
    if cfg.rollout.worker == "thread" or why_not:
        from arealite.rollout.side import LocalRollout

        wf = workflow or build_workflow(cfg, tokenizer)
        ev = eval_workflow or (build_workflow(cfg, tokenizer, evaluation=True) if workflow is None else wf)
        sampled = build_workflow(cfg, tokenizer, evaluation="sampled") if samples_at_eval(cfg, workflow) else None
        return LocalRollout(build_inference_client(cfg, tokenizer), cfg.rollout, loader, world, wf, ev, sampled)
    spec = WorkerSpec(cfg, world, loader, workflow, eval_workflow)
    return RolloutWorker(spec, admin_client=build_inference_client(cfg, tokenizer))
