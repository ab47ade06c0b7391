"""Single-turn RL with verifiable rewards: one prompt -> a group of n samples.

The n samples are generated concurrently and share an ``affinity_key``, so
they land on the same server and reuse its prefix cache. Each sample is scored
by ``reward_fn`` in a thread with a timeout; a reward function that fails is
counted and handled by ``on_reward_error`` (zero reward, or reject the group).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid
from array import array
from pathlib import Path
from typing import Any, Callable

import torch
from tensordict import TensorDict

from arealite.api.types import Completion, GenerationRequest, SamplingParams
from arealite.config.schema import GenerationConfig, RolloutConfig
from arealite.workflow.base import (
    InferenceEngine,
    RewardError,
    RewardRunner,
    RolloutWorkflow,
    group_from_outputs,
    new_group_id,
)

logger = logging.getLogger("arealite.workflow")

#: ``reward_fn(prompt, completion, prompt_ids, completion_ids, **item_fields) -> float``
RewardFn = Callable[..., float]

_RID_PREFIX = uuid.uuid4().hex[:12]

# Names reward functions receive positionally; item fields with these names are not forwarded.
_RESERVED = ("prompt", "completion", "prompt_ids", "completion_ids")


def sampling_from_config(gconfig: GenerationConfig, tokenizer: Any = None) -> SamplingParams:
    """The per-request ``SamplingParams`` of a ``GenerationConfig`` (EOS always stops)."""
    stop = list(gconfig.stop_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and eos not in stop:
        stop.append(int(eos))
    return SamplingParams(
        max_new_tokens=gconfig.max_new_tokens,
        temperature=gconfig.temperature,
        top_p=gconfig.top_p,
        top_k=gconfig.top_k,
        min_p=gconfig.min_p,
        stop_token_ids=stop,
        greedy=gconfig.greedy,
    )


def _byte_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = (b for b in range(256) if b not in set(keep))
    out = {chr(b): b for b in keep}
    out.update((chr(256 + i), b) for i, b in enumerate(extra))
    return out


class _ByteLevelTable:
    """Decodes ids of a byte-level BPE tokenizer by table lookup, in Python.

    The Rust ``decode`` spends most of its time per token on the way in and
    back out; for a few hundred ids a join of per-id bytes is ~3x cheaper.
    Built only for a ``ByteLevel`` decoder, checked against the Rust decode on
    the whole vocabulary; ids it does not know go to Rust. Invalid UTF-8 (a
    sequence cut inside a character) becomes U+FFFD per maximal invalid
    subpart in both Python's ``errors="replace"`` and Rust's ``from_utf8_lossy``.
    """

    def __init__(self, backend: Any):
        chars = _byte_chars()
        vocab = backend.get_vocab(with_added_tokens=True)
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        full: dict[int, bytes] = {}
        for tok, i in vocab.items():
            try:  # as the Rust decoder: map every char, or keep the token's UTF-8 if one is not in the alphabet
                full[i] = bytes(chars[c] for c in tok)
            except KeyError:
                full[i] = tok.encode()
        self.full = full
        self.plain = {i: (b"" if i in special else b) for i, b in full.items()}
        ids = sorted(full)
        for skip in (False, True):  # refuse to exist if it disagrees with Rust anywhere
            for a in range(0, len(ids), 4096):
                chunk = ids[a:a + 4096]
                ours = b"".join(map((self.plain if skip else full).__getitem__, chunk)).decode("utf-8", "replace")
                if ours != backend.decode(chunk, skip_special_tokens=skip):
                    raise ValueError("byte-level table disagrees with the tokenizer's decode")

    def __call__(self, ids: Any, skip_special_tokens: bool) -> str:
        # KeyError (unknown or negative id) propagates: the caller falls back to Rust.
        return b"".join(map((self.plain if skip_special_tokens else self.full).__getitem__, ids)).decode(
            "utf-8", "replace")


# tokenizer id -> (tokenizer, table or None). Holding the tokenizer keeps its id from being reused.
_TABLES: dict[int, tuple[Any, _ByteLevelTable | None]] = {}


def _table(tokenizer: Any, backend: Any) -> _ByteLevelTable | None:
    entry = _TABLES.get(id(tokenizer))
    if entry is not None and entry[0] is tokenizer:
        return entry[1]
    table = None
    if type(getattr(backend, "decoder", None)).__name__ == "ByteLevel":
        try:
            table = _ByteLevelTable(backend)
        except Exception as e:  # an unusual vocabulary: Rust decodes it, as before
            logger.debug("no byte-level decode table for %s: %s", type(tokenizer).__name__, e)
    _TABLES[id(tokenizer)] = (tokenizer, table)
    return table


def _rust(tokenizer: Any) -> Any:
    # The Rust tokenizer gives the same text as transformers' decode unless that cleans up spaces.
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


def prepare_decode(tokenizer: Any) -> None:
    """Build ``decode``'s lookup table now (a workflow's constructor), not on the event loop later."""
    backend = _rust(tokenizer)
    if backend is not None:
        _table(tokenizer, backend)


def decode(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True) -> str:
    """``tokenizer.decode``, through a lookup table or the Rust tokenizer when that gives the same text.

    transformers' ``decode`` walks the id list in Python first, which costs more
    than the decoding itself on the hot path of every sample.
    """
    backend = _rust(tokenizer)
    if backend is None:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    table = _table(tokenizer, backend)
    if table is not None:
        try:
            return table(ids, skip_special_tokens)
        except (KeyError, TypeError):
            pass
    return backend.decode(ids, skip_special_tokens=skip_special_tokens)


def decode_many(tokenizer: Any, seqs: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
    """``decode`` of several sequences.

    One by one, not with the Rust ``decode_batch``: that releases the GIL and
    must win it back, which on a busy event loop thread can cost a whole GIL
    switch interval (5 ms) per call.
    """
    return [decode(tokenizer, s, skip_special_tokens) for s in seqs]


def encode_prompt(tokenizer: Any, item: dict[str, Any], prompt_key: str, apply_chat_template: bool) -> tuple[str, list[int]]:
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


def item_fields(item: dict[str, Any]) -> dict[str, Any]:
    """The item's fields forwarded to reward functions as keyword arguments."""
    return {k: v for k, v in item.items() if k not in _RESERVED and k != "input_ids"}


class TextDumper:
    """Appends generated texts as JSONL, one file per policy version, for inspection."""

    def __init__(self, dump_dir: str | Path):
        self.dir = Path(dump_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def write(self, version: int, records: list[dict[str, Any]]) -> None:
        lines = "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records)
        with self._lock, open(self.dir / f"version_{version}.jsonl", "a", encoding="utf-8") as f:
            f.write(lines)


class RLVRWorkflow(RolloutWorkflow):
    """Prompt -> ``gconfig.n_samples`` completions -> rewards -> one group of n rows.

    Rows carry the trajectory keys plus ``prompt_id`` (the item's, -1 if none).
    """

    def __init__(
        self,
        reward_fn: RewardFn,
        gconfig: GenerationConfig,
        tokenizer: Any,
        rollout_config: RolloutConfig | None = None,
        *,
        prompt_key: str = "prompt",
        apply_chat_template: bool = False,
    ):
        if not callable(reward_fn):
            raise TypeError(f"reward_fn must be callable, got {type(reward_fn).__name__}")
        rc = rollout_config or RolloutConfig()
        self.reward_fn = reward_fn
        self.gconfig = gconfig
        self.tokenizer = tokenizer
        self.sampling = sampling_from_config(gconfig, tokenizer)
        prepare_decode(tokenizer)
        self.prompt_key = prompt_key
        self.apply_chat_template = apply_chat_template
        self.on_reward_error = rc.on_reward_error
        self.rewards = RewardRunner(rc.reward_timeout_s, rc.reward_workers)
        self.dumper = TextDumper(rc.dump_dir) if rc.dump_dir else None
        self.counters = {"reward_errors": 0, "reward_rejected_groups": 0}

    def stats(self) -> dict[str, int]:
        return {**self.counters, "reward_abandoned_threads": self.rewards.abandoned_threads}

    async def score(self, prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], item: dict[str, Any],
                    fields: dict[str, Any] | None = None) -> float | None:
        """Reward of one sample, or ``None`` if it failed and the policy is to reject.

        ``fields``: ``item_fields(item)``, when the caller already computed it for the group.
        """
        try:
            return await self.rewards(self.reward_fn, prompt, completion, prompt_ids, completion_ids,
                                      **(item_fields(item) if fields is None else fields))
        except RewardError as e:
            self.counters["reward_errors"] += 1
            logger.warning("reward error on item %s: %s", item.get("prompt_id", "?"), e)
            return None if self.on_reward_error == "reject" else 0.0

    async def arun_episode(self, engine: InferenceEngine, item: dict[str, Any]) -> TensorDict | None:
        prompt, prompt_ids = encode_prompt(self.tokenizer, item, self.prompt_key, self.apply_chat_template)
        gid = new_group_id()
        group = f"group-{gid}"
        n = self.gconfig.n_samples
        # Cheap unique request ids (uuid4 per request shows up in profiles): process prefix + group + sample.
        rid = f"{_RID_PREFIX}-{gid:x}-"
        reqs = [GenerationRequest(list(prompt_ids), self.sampling, f"{rid}{i}", group) for i in range(n)]
        fields = item_fields(item)
        tok = self.tokenizer
        if n == 1:  # the common evaluation and benchmark case: no task per sample
            comps: list[Completion] = [await engine.agenerate(reqs[0])]
            texts = [decode(tok, comps[0].output_ids)]
            rewards = [await self.score(prompt, texts[0], prompt_ids, list(comps[0].output_ids), item, fields)]
        else:
            comps = list(await asyncio.gather(*[engine.agenerate(r) for r in reqs]))
            texts = decode_many(tok, [c.output_ids for c in comps])
            rewards = await asyncio.gather(
                *[self.score(prompt, t, prompt_ids, list(c.output_ids), item, fields) for c, t in zip(comps, texts)]
            )
        if None in rewards:
            self.counters["reward_rejected_groups"] += 1
            return None
        if self.dumper is not None:
            self._dump(item, prompt, comps, texts, rewards)
        return group_from_outputs(
            prompt_ids,
            [(c.output_ids, c.output_logprobs, c.output_versions) for c in comps],
            {
                "rewards": torch.frombuffer(array("f", rewards), dtype=torch.float32),
                "group_id": torch.frombuffer(array("q", (gid,)) * n, dtype=torch.int64),
                "prompt_id": torch.frombuffer(array("q", (int(item.get("prompt_id", -1)),)) * n, dtype=torch.int64),
            },
        )

    def _dump(self, item: dict[str, Any], prompt: str, comps: list[Completion], texts: list[str], rewards: list[float | None]) -> None:
        by_version: dict[int, list[dict[str, Any]]] = {}
        for c, t, r in zip(comps, texts, rewards):
            # A sample is filed under the newest version among its tokens.
            v = max(c.output_versions) if c.output_versions else -1
            by_version.setdefault(v, []).append(
                {"prompt_id": item.get("prompt_id"), "prompt": prompt, "completion": t, "reward": r,
                 "finish_reason": c.finish_reason, "n_tokens": len(c.output_ids)}
            )
        for v, recs in by_version.items():
            self.dumper.write(v, recs)
