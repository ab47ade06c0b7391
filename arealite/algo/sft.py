"""Supervised fine-tuning on the same train engine: a loss, its weight, and a batch builder.

    batch = build_sft_batch(tokenizer, prompts, completions)
    engine.train_batch(batch, sft_loss_fn, sft_loss_weight)

The loss is the token-mean negative log-likelihood of the completion tokens
(``loss_mask``); the weight is their count, so the engine's weighted mean over
micro-batches and ranks is the NLL per completion token of the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict

from arealite.algo.loss import masked_mean
from arealite.api.contracts import HeadOutput, MicroBatch

__all__ = ["sft_loss_fn", "sft_loss_weight", "build_sft_batch"]


def sft_loss_fn(head: HeadOutput, mb: MicroBatch) -> torch.Tensor:
    """Mean cross-entropy of ``mb["labels"]`` on ``mb["loss_mask"]`` tokens (a packed micro-batch)."""
    if "loss_mask" not in mb:
        raise KeyError("SFT micro-batch lacks 'loss_mask'; build the batch with build_sft_batch")
    mask = mb["loss_mask"].bool()
    nll = -head.logprobs(mb["labels"], 1.0)
    loss = masked_mean(nll, mask)
    stats = dict(mb.get("_stats") or {})
    stats["sft_nll"] = float(loss.detach())
    stats["n_loss_tokens"] = float(mask.sum())
    mb["_stats"] = stats
    return loss


def sft_loss_weight(mb: MicroBatch) -> float:
    """The number of completion tokens of a micro-batch (the unit of ``sft_loss_fn``)."""
    return float(mb["loss_mask"].bool().sum())


def _ids(tokenizer, x: str | Sequence[int], what: str, i: int) -> list[int]:
    if isinstance(x, str):
        # No special tokens: the caller's text (or a chat template) decides them.
        return list(tokenizer(x, add_special_tokens=False)["input_ids"])
    if isinstance(x, (list, tuple)) and all(isinstance(t, int) for t in x):
        return list(x)
    raise TypeError(f"{what}[{i}] must be a string or a list of token ids, got {type(x).__name__}")


def build_sft_batch(
    tokenizer,
    prompts: Sequence[str | Sequence[int]],
    completions: Sequence[str | Sequence[int]],
    add_eos: bool = True,
    max_len: int | None = None,
) -> TensorDict:
    """Tokenise prompt/completion pairs into a right-padded TensorDict ``[B, L]``.

    Keys: ``input_ids`` (int64), ``attention_mask`` (bool), ``loss_mask`` (bool,
    True on completion tokens, including the EOS appended when ``add_eos`` so
    the model learns to stop). Strings are tokenised without special tokens;
    lists of ints are taken as token ids. A pair longer than ``max_len`` is an error.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"got {len(prompts)} prompts but {len(completions)} completions; give one completion per prompt")
    if len(prompts) == 0:
        raise ValueError("build_sft_batch needs at least one prompt/completion pair")
    eos = tokenizer.eos_token_id
    if add_eos and eos is None:
        raise ValueError("the tokenizer has no eos_token_id; pass add_eos=False or set one")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    rows: list[tuple[list[int], list[int]]] = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        p_ids, c_ids = _ids(tokenizer, p, "prompts", i), _ids(tokenizer, c, "completions", i)
        if add_eos:
            c_ids = c_ids + [eos]
        if not c_ids:
            raise ValueError(f"completions[{i}] is empty: there is nothing to train on")
        if not p_ids:
            # The first token is never predicted (nothing precedes it), so a
            # completion needs at least one token of context in front of it.
            raise ValueError(f"prompts[{i}] is empty; give at least one prompt token")
        if max_len is not None and len(p_ids) + len(c_ids) > max_len:
            raise ValueError(f"pair {i} has {len(p_ids) + len(c_ids)} tokens, more than max_len={max_len}")
        rows.append((p_ids, c_ids))
    L = max(len(p) + len(c) for p, c in rows)
    B = len(rows)
    input_ids = torch.full((B, L), pad, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.bool)
    loss_mask = torch.zeros((B, L), dtype=torch.bool)
    for b, (p, c) in enumerate(rows):
        n = len(p) + len(c)
        input_ids[b, :n] = torch.tensor(p + c, dtype=torch.long)
        attention_mask[b, :n] = True
        loss_mask[b, len(p) : n] = True
    return TensorDict(
        {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}, batch_size=[B]
    )
