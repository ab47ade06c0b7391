"""Single-turn RL with verifiable rewards: one prompt -> a group of n samples.

The n samples are generated concurrently and share an ``affinity_key``, so
they land on the same server and reuse its prefix cache. Each sample is scored
by ``reward_fn`` in a thread with a timeout; a reward function that fails is
counted and handled by ``on_reward_error`` (zero reward, or reject the group).
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from array import array
from pathlib import Path
from typing import TYPE_CHECKING

from tensordict import TensorDict

from arealite.api.types import Completion, GenerationRequest
from arealite.config.schema import GenerationConfig, RolloutConfig
from arealite.api.contracts import InferenceClient
from arealite.reward import load_reward_fn
from arealite.utils.json_types import JsonObject
from arealite.utils.tokenizer import decode, decode_many, prepare_decode
from arealite.workflow.base import RolloutWorkflow, TrajectoryGroup, new_group_id
from arealite.workflow.common import (
    RewardFn,
    RewardScorer,
    encode_item_prompt,
    item_fields,
    processor_for,
    sampling_from_config,
    vision_tensors,
)
from arealite.workflow.fast_group import GroupBuffers
from arealite.workflow.registry import builtin_workflow
from arealite.moe.trajectory import ROUTED_EXPERTS_KEY, routed_experts_of

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from arealite.config.schema import ArealiteConfig

_RID_PREFIX = uuid.uuid4().hex[:12]


class TextDumper:
    """Appends generated texts as JSONL, one file per policy version, for inspection."""

    def __init__(self, dump_dir: str | Path):
        self.dir = Path(dump_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def write(self, version: int, records: list[JsonObject]) -> None:
        lines = "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records)
        with self._lock, open(self.dir / f"version_{version}.jsonl", "a", encoding="utf-8") as f:
            f.write(lines)


@builtin_workflow("rlvr")
class RLVRWorkflow(RolloutWorkflow):
    """Prompt -> ``generation.n_samples`` completions -> rewards -> one group of n rows.

    Rows carry the trajectory keys plus ``prompt_id`` (the item's, -1 if none) and
    ``truncated`` (the sample hit ``max_new_tokens``).
    Built from a run's config by ``from_config`` (``rollout.workflow: rlvr``), or
    by keyword: ``RLVRWorkflow(reward_fn=..., generation=..., tokenizer=..., rollout=...)``.

    With a ``processor`` (a vision-language model's, `arealite.vision.processor`), the item's
    images (``image_key``) are rendered into the prompt, every request carries them
    (``image_data``) and every row ``pixel_values`` / ``image_grid_thw`` (docs/vision.md).
    """

    def __init__(
        self,
        reward_fn: RewardFn,
        generation: GenerationConfig,
        tokenizer: PreTrainedTokenizerBase,
        rollout: RolloutConfig | None = None,
        *,
        prompt_key: str = "prompt",
        apply_chat_template: bool = False,
        processor=None,
        image_key: str = "images",
        max_image_pixels: int | None = None,
    ):
        if not callable(reward_fn):
            raise TypeError(f"reward_fn must be callable, got {type(reward_fn).__name__}")
        rollout = rollout or RolloutConfig()
        self.reward_fn = reward_fn
        self.generation = generation
        self.tokenizer = tokenizer
        self.sampling = sampling_from_config(generation, tokenizer)
        prepare_decode(tokenizer)  # the decode table is built now, not on the event loop
        self.prompt_key = prompt_key
        self.apply_chat_template = apply_chat_template
        self.processor = processor
        self.image_key = image_key
        self.max_image_pixels = max_image_pixels
        self.scorer = RewardScorer(reward_fn, rollout)
        self.dumper = TextDumper(rollout.dump_dir) if rollout.dump_dir else None
        self.rejected_groups = 0

    @classmethod
    def from_config(cls, cfg: ArealiteConfig, tokenizer: PreTrainedTokenizerBase) -> RLVRWorkflow:
        """The workflow of a run: ``generation``, ``rollout``, and from ``data`` the reward
        function, prompt key and chat-template setting (it takes no ``workflow_kwargs``); for a
        vision-language model its processor and ``data.image_key`` / ``data.max_image_pixels``."""
        return cls(load_reward_fn(cfg.data.reward_fn), cfg.generation, tokenizer, cfg.rollout,
                   prompt_key=cfg.data.prompt_key, apply_chat_template=cfg.data.apply_chat_template,
                   processor=processor_for(cfg.actor.model_path), image_key=cfg.data.image_key,
                   max_image_pixels=cfg.data.max_image_pixels)

    def stats(self) -> dict[str, int]:
        return {**self.scorer.stats(), "reward_rejected_groups": self.rejected_groups}

    async def score(self, prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int],
                    item: JsonObject, fields: JsonObject | None = None) -> float | None:
        """Reward of one sample, or ``None`` if it failed and the policy is to reject.

        ``fields``: ``item_fields(item)``, when the caller already computed it for the group.
        """
        return await self.scorer(prompt, completion, prompt_ids, completion_ids,
                                 item_fields(item) if fields is None else fields)

    async def arun_episode(self, client: InferenceClient, item: JsonObject) -> TensorDict | None:
        group = await self._group(client, item)
        return group.to_tensordict() if isinstance(group, GroupBuffers) else group

    async def arun_group(self, client: InferenceClient, item: JsonObject) -> TrajectoryGroup | None:
        """The group in its buffers where it has nothing but the trajectory keys (no MoE routing,
        no images): the controller builds its tensors with the rest of the batch. A subclass
        that reshapes `arun_episode`'s TensorDict gets that instead."""
        if type(self).arun_episode is not RLVRWorkflow.arun_episode:
            return await self.arun_episode(client, item)
        return await self._group(client, item)

    async def _group(self, client: InferenceClient, item: JsonObject) -> TrajectoryGroup | None:
        prompt, prompt_ids, vision = await encode_item_prompt(
            self.tokenizer, self.processor, item, self.prompt_key, self.apply_chat_template, self.image_key,
            self.max_image_pixels)
        gid = new_group_id()
        group = f"group-{gid}"
        n = self.generation.n_samples
        # Cheap unique request ids (uuid4 per request shows up in profiles): process prefix + group + sample.
        rid = f"{_RID_PREFIX}-{gid:x}-"
        # The group's key keeps its samples on one server and sends them as one batch; a
        # lone sample (evaluation) has nothing to share and goes without one.
        key = group if n > 1 else None
        reqs = [GenerationRequest(list(prompt_ids), self.sampling, f"{rid}{i}", key) for i in range(n)]
        if vision is not None and vision.image_data:
            for r in reqs:
                r.image_data = vision.image_data
        fields = item_fields(item)
        tok = self.tokenizer
        if n == 1:  # the common evaluation and benchmark case: no task per sample
            comps: list[Completion] = [await client.agenerate(reqs[0])]
            texts = [decode(tok, comps[0].output_ids)]
            rewards = [await self.scorer(prompt, texts[0], prompt_ids, list(comps[0].output_ids), fields)]
        else:
            comps = list(await asyncio.gather(*[client.agenerate(r) for r in reqs]))
            texts = decode_many(tok, [c.output_ids for c in comps])
            rewards = await asyncio.gather(
                *[self.scorer(prompt, t, prompt_ids, list(c.output_ids), fields) for c, t in zip(comps, texts)]
            )
        if None in rewards:
            self.rejected_groups += 1
            return None
        if self.dumper is not None:
            self._dump(item, prompt, comps, texts, rewards)
        group = GroupBuffers(prompt_ids, [(c.output_ids, c.output_logprobs, c.output_versions) for c in comps], {
            "rewards": array("f", rewards),
            "group_id": array("q", (gid,)) * n,
            "prompt_id": array("q", (int(item.get("prompt_id", -1)),)) * n,
            # Cut at the length limit (DAPO overlong shaping, evaluation's truncation rate).
            "truncated": bytearray([c.finish_reason == "length" for c in comps]),
        })
        routing = routed_experts_of(comps, group.width)  # MoE routing replay (R3)
        if routing is None and vision is None:
            return group
        td = group.to_tensordict()
        if routing is not None:
            td[ROUTED_EXPERTS_KEY] = routing
        if vision is not None:
            td.update(vision_tensors(vision, n))
        return td

    def _dump(self, item: JsonObject, prompt: str, comps: list[Completion], texts: list[str],
              rewards: list[float | None]) -> None:
        by_version: dict[int, list[JsonObject]] = {}
        for c, t, r in zip(comps, texts, rewards):
            # A sample is filed under the newest version among its tokens.
            v = max(c.output_versions) if c.output_versions else -1
            by_version.setdefault(v, []).append(
                {"prompt_id": item.get("prompt_id"), "prompt": prompt, "completion": t, "reward": r,
                 "finish_reason": c.finish_reason, "n_tokens": len(c.output_ids)}
            )
        for v, recs in by_version.items():
            self.dumper.write(v, recs)
