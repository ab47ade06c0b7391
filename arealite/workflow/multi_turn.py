"""Multi-turn episodes: the model answers, the environment replies, the model tries again.

Token-in/token-out: the conversation lives as one list of token ids. Each
model turn appends exactly the tokens the server generated; each environment
reply appends the token piece of a user turn, cut from the tokenizer's chat
template. Nothing already in the conversation is ever re-tokenized, so the
log-probs the server returned stay aligned with the tokens trained on, and
``loss_mask`` covers exactly the assistant's tokens.

Two output forms:

- ``per_step=False`` (default): one row per conversation, reward
  ``r_last * turn_discount ** last_turn`` (a correct answer after two retries
  is worth less than a first-try one).
- ``per_step=True``: for environments with a reward per step, one row per
  model turn (its context with ``loss_mask`` False, its own tokens True),
  sharing ``traj_id``, with ``step_id`` and ``n_steps``, so the algorithm can
  broadcast step-wise advantages.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable

import torch
from tensordict import TensorDict

from arealite.api.contracts import InferenceClient
from arealite.api.types import Completion, GenerationRequest
from arealite.config.schema import GenerationConfig, RolloutConfig
from arealite.reward import load_reward_fn
from arealite.reward.pool import RewardError
from arealite.utils.imports import import_callable
from arealite.utils.json_types import JsonObject
from arealite.utils.tokenizer import decode
from arealite.workflow.base import RolloutWorkflow, new_group_id, pad_and_stack, trajectory_row
from arealite.workflow.common import (
    RewardFn,
    RewardScorer,
    encode_item_prompt,
    item_fields,
    processor_for,
    sampling_from_config,
    user_turn_piece,
    vision_tensors,
)
from arealite.workflow.registry import builtin_workflow
from arealite.moe.trajectory import ROUTED_EXPERTS_KEY, conversation_routed_experts

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from arealite.config.schema import ArealiteConfig


@dataclass
class StepResult:
    """What the environment says about one model turn."""

    reward: float
    done: bool
    feedback: str | None = None  # the next user turn when not done


#: One piece of a conversation: ``(ids, logprobs, versions)``, logprobs and versions ``None``
#: for the pieces the model did not generate.
Piece = tuple[list[int], list[float] | None, list[int] | None]

#: ``env(item, completion_text, completion_ids, turn) -> StepResult`` (a coroutine function).
Environment = Callable[[JsonObject, str, list[int], int], Awaitable[StepResult]]


@builtin_workflow("multi_turn")
class MultiTurnWorkflow(RolloutWorkflow):
    """Up to ``max_turns`` model turns per conversation; ``generation.n_samples`` conversations per group.

    Without an ``env``, the default environment scores each answer with
    ``reward_fn``; an answer scoring ``>= success_reward`` ends the
    conversation, any other gets ``feedback`` as the next user turn.
    Built from a run's config by ``from_config`` (``rollout.workflow: multi_turn``,
    its settings in ``rollout.workflow_kwargs``), or by keyword.

    With a ``processor`` (a vision-language model's), the item's images go into the first
    prompt; every turn's request carries them (the conversation's ids hold their
    placeholders) and every row ``pixel_values`` / ``image_grid_thw`` (docs/vision.md).
    """

    def __init__(
        self,
        reward_fn: RewardFn | None,
        generation: GenerationConfig,
        tokenizer: PreTrainedTokenizerBase,
        rollout: RolloutConfig | None = None,
        *,
        max_turns: int = 3,
        turn_discount: float = 0.9,
        feedback: str = "Your answer is wrong. Please think again and give the final answer.",
        success_reward: float = 1.0,
        env: Environment | None = None,
        per_step: bool = False,
        prompt_key: str = "prompt",
        processor=None,
        image_key: str = "images",
        max_image_pixels: int | None = None,
    ):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if not 0 < turn_discount <= 1:
            raise ValueError(f"turn_discount must be in (0, 1], got {turn_discount}")
        if env is None and reward_fn is None:
            raise ValueError("give either reward_fn (default environment) or env")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("MultiTurnWorkflow needs a tokenizer with a chat template (tokenizer.chat_template is None)")
        rollout = rollout or RolloutConfig()
        self.reward_fn = reward_fn
        self.generation = generation
        self.tokenizer = tokenizer
        self.sampling = sampling_from_config(generation, tokenizer)
        self.max_turns = max_turns
        self.turn_discount = turn_discount
        self.feedback = feedback
        self.success_reward = success_reward
        self.env = env
        self.per_step = per_step
        self.prompt_key = prompt_key
        self.processor = processor
        self.image_key = image_key
        self.max_image_pixels = max_image_pixels
        self.scorer = RewardScorer(reward_fn, rollout) if reward_fn is not None else None
        self.counters = {"reward_rejected_groups": 0, "turns": 0}

    @classmethod
    def from_config(
        cls,
        cfg: ArealiteConfig,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_turns: int | None = None,
        turn_discount: float | None = None,
        feedback: str | None = None,
        success_reward: float | None = None,
        env: str | Environment | None = None,
        per_step: bool | None = None,
    ) -> MultiTurnWorkflow:
        """The workflow of a run: ``generation``, ``rollout``, the reward function and prompt
        key from ``data``, and the keyword arguments (``rollout.workflow_kwargs``; one left
        out keeps the constructor's default). ``env`` may be ``module:function``."""
        if isinstance(env, str):
            env = import_callable(env, "rollout.workflow_kwargs.env")
        given = {"max_turns": max_turns, "turn_discount": turn_discount, "feedback": feedback,
                 "success_reward": success_reward, "env": env, "per_step": per_step}
        reward_fn = load_reward_fn(cfg.data.reward_fn) if env is None else None
        return cls(reward_fn, cfg.generation, tokenizer, cfg.rollout, prompt_key=cfg.data.prompt_key,
                   processor=processor_for(cfg.actor.model_path), image_key=cfg.data.image_key,
                   max_image_pixels=cfg.data.max_image_pixels, **{k: v for k, v in given.items() if v is not None})

    def stats(self) -> dict[str, int]:
        return {**self.counters, **(self.scorer.stats() if self.scorer is not None else
                                    {"reward_errors": 0, "reward_abandoned_threads": 0})}

    # -- token pieces of the chat template ---------------------------------
    def user_turn_piece(self, text: str) -> list[int]:
        """Tokens that close the assistant turn, add a user turn ``text`` and open the next
        assistant turn (``arealite.workflow.common.user_turn_piece``)."""
        return user_turn_piece(self.tokenizer, text)

    async def _default_env(
        self, item: JsonObject, completion: str, completion_ids: list[int], turn: int, prompt_ids: list[int]
    ) -> StepResult:
        prompt = item.get(self.prompt_key, "")
        prompt = prompt if isinstance(prompt, str) else str(prompt)
        r = await self.scorer(prompt, completion, prompt_ids, completion_ids, item_fields(item))
        if r is None:  # rollout.on_reward_error=reject: the whole group goes
            raise RewardError(f"reward function failed on item {item.get('prompt_id', '?')}")
        done = r >= self.success_reward
        return StepResult(r, done, None if done else self.feedback)

    # -- one conversation ---------------------------------------------------
    async def _conversation(self, client: InferenceClient, item: JsonObject, prompt_ids: list[int], affinity: str,
                            image_data: list[str] | None = None
                            ) -> tuple[list[Piece], list[tuple[int, float]], list[Completion]]:
        ids = list(prompt_ids)
        comps: list[Completion] = []
        pieces: list[Piece] = []
        steps: list[tuple[int, float]] = []  # (index into pieces of the model turn, reward)
        for turn in range(self.max_turns):
            comp: Completion = await client.agenerate(
                GenerationRequest(input_ids=list(ids), sampling=self.sampling, affinity_key=affinity,
                                  image_data=image_data)
            )
            comps.append(comp)
            out = list(comp.output_ids)
            pieces.append((out, list(comp.output_logprobs), list(comp.output_versions)))
            ids.extend(out)
            self.counters["turns"] += 1
            text = decode(self.tokenizer, out)
            if self.env is None:
                res = await self._default_env(item, text, out, turn, prompt_ids)
            else:
                res = await self.env(item, text, out, turn)
            steps.append((len(pieces) - 1, float(res.reward)))
            if res.done or turn == self.max_turns - 1:
                break
            if res.feedback is None:
                raise ValueError(f"environment returned done=False without feedback at turn {turn}")
            # The model may already have closed its turn with the template's end token.
            piece = user_turn_piece(self.tokenizer, res.feedback, after=out)
            pieces.append((piece, None, None))
            ids.extend(piece)
        return pieces, steps, comps

    async def arun_episode(self, client: InferenceClient, item: JsonObject) -> TensorDict | None:
        _, prompt_ids, vision = await encode_item_prompt(self.tokenizer, self.processor, item, self.prompt_key,
                                                         True, self.image_key, self.max_image_pixels)
        image_data = (vision.image_data or None) if vision is not None else None
        gid = new_group_id()
        try:
            convs = await asyncio.gather(*(self._conversation(client, item, prompt_ids, f"group-{gid}", image_data)
                                           for _ in range(self.generation.n_samples)))
        except RewardError:
            self.counters["reward_rejected_groups"] += 1
            return None
        rows, per_row = [], {"rewards": [], "traj_id": [], "step_id": [], "n_steps": []}
        row_turns: list[list[Completion]] = []  # the model turns behind each row (MoE routing)
        for pieces, steps, comps in convs:
            traj = new_group_id()
            if self.per_step:
                for s, (idx, r) in enumerate(steps):
                    context = [(p[0], None, None) for p in pieces[:idx]]
                    rows.append(trajectory_row(prompt_ids, context + [pieces[idx]]))
                    row_turns.append(comps[:s + 1])
                    per_row["rewards"].append(r)
                    per_row["traj_id"].append(traj)
                    per_row["step_id"].append(s)
                    per_row["n_steps"].append(len(steps))
            else:
                rows.append(trajectory_row(prompt_ids, pieces))
                row_turns.append(comps)
                last_turn, r = len(steps) - 1, steps[-1][1]
                per_row["rewards"].append(r * self.turn_discount**last_turn)
                per_row["traj_id"].append(traj)
                per_row["step_id"].append(last_turn)
                per_row["n_steps"].append(len(steps))
        n = len(rows)
        tensors = {
            "rewards": torch.tensor(per_row["rewards"], dtype=torch.float32),
            "group_id": torch.full((n,), gid, dtype=torch.int64),
            "prompt_id": torch.full((n,), int(item.get("prompt_id", -1)), dtype=torch.int64),
        }
        for k in ("traj_id", "step_id", "n_steps"):
            tensors[k] = torch.tensor(per_row[k], dtype=torch.int64)
        if vision is not None:
            tensors.update(vision_tensors(vision, n))
        td = pad_and_stack(rows, tensors)
        routing = conversation_routed_experts(row_turns, [r["input_ids"].shape[0] for r in rows],
                                              td["input_ids"].shape[1])  # MoE routing replay (R3)
        if routing is not None:
            td[ROUTED_EXPERTS_KEY] = routing
        return td
