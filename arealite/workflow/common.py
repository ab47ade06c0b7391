"""What the built-in workflows share: sampling from config, prompt and turn encoding, reward scoring.

``RLVRWorkflow`` and ``MultiTurnWorkflow`` both turn a dataset item into prompt
tokens the same way, forward the same item fields to the reward function and
apply the same ``rollout.on_reward_error`` policy; they take those from here.
Your own workflow may use them too (``user_turn_piece`` for a conversation
kept as token ids).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from arealite.api.types import SamplingParams
from arealite.config.schema import GenerationConfig, RolloutConfig
from arealite.reward.pool import RewardError, RewardRunner
from arealite.utils.json_types import JsonObject
from arealite.utils.tokenizer import decode

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from arealite.vision.prompt import VisionPrompt

logger = logging.getLogger("arealite.workflow")

#: ``reward_fn(prompt, completion, prompt_ids, completion_ids, **item_fields) -> float``
RewardFn = Callable[..., float]

# Names reward functions receive positionally; item fields with these names are not forwarded.
_RESERVED = ("prompt", "completion", "prompt_ids", "completion_ids")


def sampling_from_config(generation: GenerationConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> SamplingParams:
    """The per-request ``SamplingParams`` of a ``GenerationConfig`` (EOS always stops)."""
    stop = list(generation.stop_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and eos not in stop:
        stop.append(int(eos))
    return SamplingParams(
        max_new_tokens=generation.max_new_tokens,
        temperature=generation.temperature,
        top_p=generation.top_p,
        top_k=generation.top_k,
        min_p=generation.min_p,
        stop_token_ids=stop,
        greedy=generation.greedy,
    )


def encode_prompt(tokenizer: PreTrainedTokenizerBase, item: JsonObject, prompt_key: str,
                  apply_chat_template: bool) -> tuple[str, list[int]]:
    """Prompt text and token ids of an item.

    A ``messages`` list (``[{role, content}, ...]``) always goes through the chat
    template; a string only when ``apply_chat_template`` is set. An item that
    already carries ``input_ids`` is used as is (token-in).
    """
    if "input_ids" in item:
        ids = list(item["input_ids"])
        return decode(tokenizer, ids, skip_special_tokens=False), ids
    if prompt_key not in item:
        raise KeyError(f"item has no prompt field '{prompt_key}' (fields: {sorted(item)}); set the prompt key")
    prompt = item[prompt_key]
    if isinstance(prompt, list) or apply_chat_template:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    elif isinstance(prompt, str):
        text = prompt
    else:
        raise TypeError(f"item field '{prompt_key}' must be a string or a list of messages, got {type(prompt).__name__}")
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ValueError(f"item field '{prompt_key}' encodes to no tokens: {prompt!r:.80}")
    return text, list(ids)


def is_vision_model(model_path: str | os.PathLike | None) -> bool:
    """Whether the model directory holds a vision-language model (a ``vision_config``)."""
    if not model_path:
        return False
    try:
        return "vision_config" in json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def processor_for(model_path: str | os.PathLike | None):
    """The model's processor when it is a vision-language model, else None (a text run never
    loads one). Workflows render image prompts with it (`encode_vision_prompt`)."""
    if not is_vision_model(model_path):
        return None
    from arealite.vision.processor import load_processor

    return load_processor(model_path)


async def encode_vision_prompt(processor, item: JsonObject, prompt_key: str, image_key: str,
                               apply_chat_template: bool, max_pixels: int | None = None) -> tuple[str, VisionPrompt]:
    """Prompt text and `VisionPrompt` of an item of a vision run (its images under ``image_key``,
    possibly none), rendered through ``processor`` in a worker thread (decoding and resizing
    images is CPU work that must not hold the event loop)."""
    from arealite.vision.prompt import prompt_text

    if prompt_key not in item:
        raise KeyError(f"item has no prompt field '{prompt_key}' (fields: {sorted(item)}); set the prompt key")

    def render() -> tuple[str, VisionPrompt]:
        vp = render_vision_item(processor, item, prompt_key, image_key, apply_chat_template, max_pixels)
        return prompt_text(processor, item[prompt_key], apply_chat_template), vp

    return await asyncio.to_thread(render)


def render_vision_item(processor, item: JsonObject, prompt_key: str, image_key: str,
                       apply_chat_template: bool, max_pixels: int | None = None) -> VisionPrompt:
    """The `VisionPrompt` of an item of a vision run, rendered here (CPU work: on an event loop,
    use `encode_vision_prompt`)."""
    from arealite.data.image_sources import as_list
    from arealite.vision.image_io import image_bytes
    from arealite.vision.prompt import render_vision_prompt

    where = f"item {item.get('prompt_id', '?')} field '{image_key}'"
    images = [image_bytes(s, f"{where}[{j}]") for j, s in enumerate(as_list(item.get(image_key)))]
    return render_vision_prompt(processor, item[prompt_key], images, apply_chat_template=apply_chat_template,
                                max_pixels=max_pixels, where=where)


async def encode_item_prompt(tokenizer: PreTrainedTokenizerBase, processor, item: JsonObject, prompt_key: str,
                             apply_chat_template: bool, image_key: str, max_image_pixels: int | None
                             ) -> tuple[str, list[int], VisionPrompt | None]:
    """Prompt text, token ids and, with a vision-language model's ``processor``, the
    `VisionPrompt` (None for a text model: `encode_prompt`, nothing more)."""
    if processor is None:
        text, ids = encode_prompt(tokenizer, item, prompt_key, apply_chat_template)
        return text, ids, None
    text, vp = await encode_vision_prompt(processor, item, prompt_key, image_key, apply_chat_template,
                                          max_image_pixels)
    return text, vp.input_ids, vp


def vision_tensors(vp: VisionPrompt, n: int) -> dict[str, torch.Tensor]:
    """The trajectory keys of ``n`` rows that share ``vp``'s images: ``pixel_values``
    ``[n, P, D]`` and ``image_grid_thw`` ``[n, N, 3]`` (docs/vision.md)."""
    return {"pixel_values": vp.pixel_values.unsqueeze(0).repeat(n, 1, 1),
            "image_grid_thw": vp.image_grid_thw.unsqueeze(0).repeat(n, 1, 1)}


# Stands for the assistant's reply when a turn piece is cut from a rendered conversation.
_SENTINEL = "\u2063AREALITE_SENTINEL\u2063"


def user_turn_piece(tokenizer: PreTrainedTokenizerBase, text: str, after: Sequence[int] = ()) -> list[int]:
    """Token ids that close the assistant turn, add a user turn ``text`` and open the next assistant turn.

    Cut from the tokenizer's chat template (a rendered conversation, after a
    sentinel assistant message, so that templates which add a default system
    prompt still give the right piece). Appended to the ids the model generated,
    it continues the conversation token-in/token-out: nothing already generated
    is re-tokenized. ``after``: the model's last turn; when it already ends
    with the template's end-of-turn token, that token is not repeated.
    """
    msgs = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": _SENTINEL},
        {"role": "user", "content": text},
    ]
    rendered = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    if _SENTINEL not in rendered:
        raise ValueError("the chat template drops assistant content; cannot cut turn pieces from it")
    piece = list(tokenizer.encode(rendered.split(_SENTINEL, 1)[1], add_special_tokens=False))
    if after and piece and after[-1] == piece[0]:
        piece = piece[1:]
    return piece


def item_fields(item: JsonObject) -> JsonObject:
    """The item's fields forwarded to reward functions as keyword arguments."""
    return {k: v for k, v in item.items() if k not in _RESERVED and k != "input_ids"}


class RewardScorer:
    """A workflow's ``reward_fn``, run off the event loop under the rollout config's policy.

    Each call runs in a ``RewardRunner`` thread with ``rollout.reward_timeout_s``;
    a call that fails (raises, hangs, returns a non-number) is counted in
    ``errors`` and, per ``rollout.on_reward_error``, scores 0.0 (``zero``) or
    ``None`` (``reject``: the caller drops the group).
    """

    def __init__(self, reward_fn: RewardFn, rollout: RolloutConfig):
        self.reward_fn = reward_fn
        self.runner = RewardRunner(rollout.reward_timeout_s, rollout.reward_workers)
        self.reject_on_error = rollout.on_reward_error == "reject"
        self.errors = 0

    async def __call__(self, prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int],
                       fields: JsonObject) -> float | None:
        """``reward_fn(prompt, completion, prompt_ids, completion_ids, **fields)``, or the error policy's value."""
        try:
            return await self.runner(self.reward_fn, prompt, completion, prompt_ids, completion_ids, **fields)
        except RewardError as e:
            self.errors += 1
            logger.warning("reward error on item %s: %s", fields.get("prompt_id", "?"), e)
            return None if self.reject_on_error else 0.0

    def stats(self) -> dict[str, int]:
        """``reward_errors`` and ``reward_abandoned_threads`` (calls that timed out while running)."""
        return {"reward_errors": self.errors, "reward_abandoned_threads": self.runner.abandoned_threads}
