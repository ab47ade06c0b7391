"""Check every prompt against the tokenizer and the length limits before training starts.

A prompt that is too long would otherwise surface mid-run as an HTTP 400 from
the inference server, after models are loaded and steps are spent. Here every
prompt is tokenized once, exactly as the RLVR workflow will, and all offending
rows are reported together: the first few by line and prompt id, then a count.
Rows with images (vision-language data) have their images checked first, by
`arealite.vision.dataset_checks` (data imports nothing above it); the tokens the images expand
into come in as ``extra_tokens`` and count toward the prompt's length.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from arealite.data.dataset import DatasetError
from arealite.utils.json_types import JsonObject, JsonValue

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from arealite.config.schema import ArealiteConfig

#: Offending rows shown in full in an error; the rest are counted.
SHOW_ROWS = 5


def _where(items: Sequence[JsonValue], i: int) -> str:
    where = items.where(i) if hasattr(items, "where") else f"row {i}"
    item = items[i]
    pid = item.get("prompt_id") if isinstance(item, dict) else None
    return f"{where} (prompt_id {pid})" if pid is not None else where


def _tokenizer_name(tokenizer: PreTrainedTokenizerBase, tokenizer_path: str | os.PathLike | None) -> str:
    return str(tokenizer_path or getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def _prompt_text(item: JsonValue, prompt_key: str, apply_chat_template: bool, has_template: bool,
                 tokenizer: PreTrainedTokenizerBase, tokenizer_label: str, vocab: int) -> str | int | tuple[str, str]:
    """What one row holds: the text to tokenize, the length of its ``input_ids`` (token-in),
    or ``(kind, detail)`` of what is wrong with it."""
    if not isinstance(item, dict):
        return "type", f"is a {type(item).__name__}, not a JSON object"
    if "input_ids" in item:  # token-in: used as is by the workflow
        ids = item["input_ids"]
        if not isinstance(ids, (list, tuple)) or not ids or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids
        ):
            return "type", f"field 'input_ids' must be a non-empty list of token ids in [0, {vocab})"
        return len(ids)
    if prompt_key not in item:
        return "type", f"missing field '{prompt_key}' (fields: {sorted(item)}); set data.prompt_key"
    prompt = item[prompt_key]
    if isinstance(prompt, list):
        if not has_template:
            return "template", (f"field '{prompt_key}' holds chat messages but the tokenizer of "
                                f"{tokenizer_label} has no chat template")
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    if isinstance(prompt, str):
        if not apply_chat_template:
            return prompt
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
    return "type", f"field '{prompt_key}' must be a string or a list of chat messages, got {type(prompt).__name__}"


def _length_problem(n: int, prompt_key: str, max_prompt_len: int | None, context_length: int | None,
                    max_new_tokens: int, max_new_tokens_name: str, context_name: str) -> tuple[str, str] | None:
    """``(kind, detail)`` when a prompt of ``n`` tokens is empty or too long, else None."""
    if n == 0:
        return "empty", f"field '{prompt_key}' encodes to no tokens"
    if max_prompt_len is not None and n > max_prompt_len:
        return "long", f"{n} tokens > data.max_prompt_len = {max_prompt_len}"
    if context_length is not None and n + max_new_tokens > context_length:
        return "context", (f"{n} tokens + {max_new_tokens_name} {max_new_tokens} = {n + max_new_tokens} "
                           f"> {context_name} = {context_length}")
    return None


def validate_prompts(
    items: Sequence[JsonObject],
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompt_key: str = "prompt",
    apply_chat_template: bool = False,
    max_prompt_len: int | None = None,
    context_length: int | None = None,
    max_new_tokens: int = 0,
    tokenizer_path: str | os.PathLike | None = None,
    dataset: str = "dataset",
    context_name: str = "the context length",
    max_new_tokens_name: str = "generation.max_new_tokens",
    vocab_size: int | None = None,
    extra_tokens: Sequence[int] | None = None,
) -> list[int]:
    """Tokenize every prompt once; return the prompt lengths, or raise ``DatasetError`` listing every bad row.

    A row is bad when its prompt is missing or of the wrong type, encodes to no
    tokens, holds chat messages but the tokenizer has no chat template, is longer
    than ``max_prompt_len``, or leaves no room for ``max_new_tokens`` within
    ``context_length``. ``dataset``, ``context_name`` and ``max_new_tokens_name``
    only shape the message (config field names, so that it says what to change).
    Token-in rows (``input_ids``) must hold ids below ``vocab_size`` (default: the tokenizer's size).
    ``extra_tokens[i]``: tokens row i gains beyond its text (its images' expanded placeholders).
    """
    if not items:
        raise DatasetError(f"{dataset}: no prompts; a dataset needs at least one row")
    has_template = getattr(tokenizer, "chat_template", None) is not None
    label = _tokenizer_name(tokenizer, tokenizer_path)
    if apply_chat_template and not has_template:
        raise DatasetError(
            f"data.apply_chat_template is true but the tokenizer of {label} "
            "has no chat template (no `chat_template` in its tokenizer_config.json); set "
            "data.apply_chat_template=false for plain-text prompts, or use a model whose tokenizer has one"
        )
    vocab = max(vocab_size or 0, len(tokenizer))
    bad: list[tuple[int, str, str]] = []  # (row, kind, detail)
    texts: list[str] = []
    text_rows: list[int] = []
    lengths: list[int] = [0] * len(items)
    for i, item in enumerate(items):
        got = _prompt_text(item, prompt_key, apply_chat_template, has_template, tokenizer, label, vocab)
        if isinstance(got, tuple):
            bad.append((i, *got))
        elif isinstance(got, int):
            lengths[i] = got
        else:
            texts.append(got)
            text_rows.append(i)
    # One batched call: the fast tokenizers encode a list in parallel, and give the same ids as encode().
    for start in range(0, len(texts), 4096):
        encoded = tokenizer(texts[start:start + 4096], add_special_tokens=False)["input_ids"]
        for i, ids in zip(text_rows[start:start + 4096], encoded):
            lengths[i] = len(ids)
    flagged = {i for i, _, _ in bad}
    if extra_tokens is not None:
        lengths = [n + extra for n, extra in zip(lengths, extra_tokens)]
    for i, n in enumerate(lengths):
        problem = None if i in flagged else _length_problem(
            n, prompt_key, max_prompt_len, context_length, max_new_tokens, max_new_tokens_name, context_name)
        if problem is not None:
            bad.append((i, *problem))
    if bad:
        raise DatasetError(_report(items, bad, dataset, max_new_tokens_name))
    return lengths


_FIXES = {
    "type": "fix the rows' fields",
    "template": "use a tokenizer with a chat template or plain-text prompts",
    "empty": "remove the empty prompts",
    "long": "shorten or remove the long prompts, or raise data.max_prompt_len",
    "context": "shorten the prompts, lower {max_new}, or raise the context length",
}
_KINDS = {"type": "malformed", "template": "without a chat template", "empty": "empty",
          "long": "longer than data.max_prompt_len", "context": "beyond the context length"}


def _report(items: Sequence[JsonValue], bad: list[tuple[int, str, str]], dataset: str, max_new: str) -> str:
    bad.sort()
    lines = [f"{dataset}: {len(bad)} of {len(items)} prompts cannot be used:"]
    lines += [f"  {_where(items, i)}: {detail}" for i, _, detail in bad[:SHOW_ROWS]]
    counts: dict[str, int] = {}
    for _, kind, _ in bad:
        counts[kind] = counts.get(kind, 0) + 1
    if len(bad) > SHOW_ROWS:
        lines.append(f"  ... and {len(bad) - SHOW_ROWS} more")
    lines.append("  in all: " + ", ".join(f"{n} {_KINDS[k]}" for k, n in counts.items()))
    lines.append("Fix: " + "; ".join(_FIXES[k].format(max_new=max_new) for k in counts) + ".")
    return "\n".join(lines)


def read_hf_config(model: Path) -> JsonObject:
    """The model directory's ``config.json`` as a dict ({} when missing or unreadable)."""
    try:
        hf = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return hf if isinstance(hf, dict) else {}


def model_context_length(cfg: ArealiteConfig) -> tuple[int | None, str]:
    """The servers' context length and where it comes from (a config field or the model's config.json)."""
    if cfg.launch.server_backend == "sglang" and cfg.server.sglang.context_length is not None:
        return cfg.server.sglang.context_length, "server.sglang.context_length"
    if cfg.launch.server_backend in ("embedded", "sim") and cfg.server.context_length is not None:
        return cfg.server.context_length, "server.context_length"
    model = Path(cfg.server.model_path or cfg.actor.model_path)
    hf = read_hf_config(model)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(hf.get(key), int):
            return hf[key], f"{key} of {model / 'config.json'}"
    return None, "the context length"


def validate_datasets(
    cfg: ArealiteConfig,
    tokenizer: PreTrainedTokenizerBase,
    train_items: Sequence[JsonObject],
    eval_items: Sequence[JsonObject] = (),
    world_size: int | None = None,
    extra_tokens: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, list[int]]:
    """Every check a training script needs on its datasets, with config field names in the errors.

    Train prompts are checked against ``generation.max_new_tokens``, eval prompts
    against ``evaluation.max_new_tokens`` (when set); the training set must fill
    one batch of ``rollout.consumer_batch_size`` on every trainer rank.
    ``extra_tokens``: per dataset (``"train"``, ``"eval"``), the tokens each row gains beyond
    its text: its images' (`arealite.vision.dataset_checks.dataset_image_tokens`, which checks
    the images first). Returns the prompt lengths of each dataset.
    """
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    ctx, ctx_name = model_context_length(cfg)
    extra = extra_tokens or {}
    common = dict(prompt_key=cfg.data.prompt_key, apply_chat_template=cfg.data.apply_chat_template,
                  max_prompt_len=cfg.data.max_prompt_len, context_length=ctx, context_name=ctx_name,
                  tokenizer_path=cfg.actor.model_path,
                  vocab_size=read_hf_config(Path(cfg.actor.model_path)).get("vocab_size"))
    out = {"train": validate_prompts(train_items, tokenizer, max_new_tokens=cfg.generation.max_new_tokens,
                                     dataset=cfg.data.describe("train"),
                                     extra_tokens=extra.get("train"), **common)}
    per_rank_batch = cfg.rollout.consumer_batch_size // world
    if len(train_items) // world < per_rank_batch:
        raise DatasetError(
            f"{cfg.data.describe('train')} has {len(train_items)} prompts, fewer than one batch: "
            f"rollout.consumer_batch_size = {cfg.rollout.consumer_batch_size} over {world} trainer rank(s) "
            f"needs at least {per_rank_batch * world}; lower rollout.consumer_batch_size or add prompts"
        )
    if eval_items:
        eval_new = cfg.evaluation.max_new_tokens
        out["eval"] = validate_prompts(
            eval_items, tokenizer, dataset=cfg.data.describe("eval"),
            max_new_tokens=eval_new or cfg.generation.max_new_tokens,
            max_new_tokens_name="evaluation.max_new_tokens" if eval_new else "generation.max_new_tokens",
            extra_tokens=extra.get("eval"), **common)
    return out
