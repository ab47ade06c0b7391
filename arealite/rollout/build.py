"""Builders of one rank's rollout side from config: its inference client and its
`LocalRollout` (client, controller, dataloader, workflows).

The trainer's process uses them (``rollout.worker: thread``, and the client of its own
that the weight publisher administers the servers with); so does the rollout worker's
child process, which builds its `LocalRollout` here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from arealite.api.contracts import InferenceClient
from arealite.config.run import server_addrs, server_api_key
from arealite.config.schema import ArealiteConfig
from arealite.rollout.side import LocalRollout
from arealite.utils.tokenizer import vocab_bound
from arealite.workflow.base import RolloutWorkflow
from arealite.workflow.registry import build_workflow, samples_at_eval

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from arealite.utils.accounting import EpochTagged

__all__ = ["build_inference_client", "build_local_rollout"]


def build_inference_client(cfg: ArealiteConfig, tokenizer: PreTrainedTokenizerBase) -> InferenceClient:
    """The inference client of `launch.server_backend`'s servers (`arealite.inference_client.backends`)."""
    from arealite.inference_client.backends import client_class

    return client_class(cfg.launch.server_backend)(
        server_addrs(cfg), cfg.rollout, api_key=server_api_key(cfg), eos_token_ids=[tokenizer.eos_token_id],
        vocab_size=vocab_bound(cfg.actor.model_path, tokenizer),
        lora_adapter=cfg.actor.lora.served_name if cfg.actor.lora is not None else None,
        return_routed_experts=cfg.algorithm.routing_replay == "r3", pause_mode=cfg.weight_sync.pause_mode)


def build_local_rollout(cfg: ArealiteConfig, tokenizer: PreTrainedTokenizerBase, loader: EpochTagged,
                        world_size: int, workflow: RolloutWorkflow | None = None,
                        eval_workflow: RolloutWorkflow | None = None) -> LocalRollout:
    """This rank's rollout side in this process, with a client of its own.

    ``workflow`` None: built from ``rollout.workflow`` (and its greedy copy for evaluation);
    a given workflow without an ``eval_workflow`` also evaluates.
    """
    wf = workflow or build_workflow(cfg, tokenizer)
    ev = eval_workflow or (build_workflow(cfg, tokenizer, evaluation=True) if workflow is None else wf)
    sampled = build_workflow(cfg, tokenizer, evaluation="sampled") if samples_at_eval(cfg, workflow) else None
    return LocalRollout(build_inference_client(cfg, tokenizer), cfg.rollout, loader, world_size, wf, ev, sampled)
