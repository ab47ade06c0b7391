"""Build a tiny but real Hugging Face causal LM directory, offline.

Nothing can be downloaded from a model hub on CI or a laptop without network,
so tests, the demo and the benchmarks use a model written here: a Qwen2-style
decoder, or with a ``moe-*`` size a Qwen3-MoE mixture of experts (``config.json`` +
``model.safetensors``, deterministic for a seed), a
byte-level BPE tokenizer trained locally with ``tokenizers`` (``tokenizer.json``),
and a chat template. The directory loads with ``AutoTokenizer`` and
``AutoModelForCausalLM`` like any hub model, so the loading code under test is
the real one.

    python -m arealite.models.tiny OUT_DIR --size small --seed 0
    python -m arealite.models.tiny OUT_DIR --size moe-micro   # Qwen3-MoE, 8 experts, top-2
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

#: Named sizes: hidden, layers, heads, kv heads, intermediate, vocab.
SIZES: dict[str, dict[str, int]] = {
    # ~0.1M parameters: unit tests.
    "micro": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, vocab_size=512),
    # ~1M: the CPU demo and end-to-end tests.
    "small": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=384, vocab_size=512),
    # ~10M
    "base": dict(hidden_size=320, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4, intermediate_size=960, vocab_size=1024),
    # ~50M: weight-sync and training benchmarks.
    "large": dict(hidden_size=640, num_hidden_layers=10, num_attention_heads=10,
                  num_key_value_heads=5, intermediate_size=1920, vocab_size=4096),
}

#: Named mixture-of-experts sizes (``Qwen3MoeForCausalLM``): every decoder layer is a sparse
#: MoE block of ``num_experts`` experts of width ``moe_intermediate_size``, ``num_experts_per_tok``
#: of them per token (docs/moe.md).
MOE_SIZES: dict[str, dict[str, int]] = {
    # ~0.2M parameters: unit tests.
    "moe-micro": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      vocab_size=512),
    # ~1M: the MoE demo and bench_moe.
    "moe-small": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                      vocab_size=512),
}

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, IM_START, IM_END]

# A Qwen-style chat template: turns are `<|im_start|>role\ncontent<|im_end|>\n`. With `tools=`
# a short system turn names them; an assistant turn renders its tool calls in the Hermes/Qwen
# form `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; a tool result is a `tool`
# turn. Plain conversations render exactly as without tools.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n' }}{% endif %}"
    "{{ 'Tools: ' }}{% for t in tools %}{{ t['function']['name'] if t['function'] is defined else t['name'] }}"
    "{% if not loop.last %}{{ ', ' }}{% endif %}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% set f = call['function'] if call['function'] is defined else call %}"
    "{{ '<tool_call>{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{{ f['arguments'] if f['arguments'] is string else f['arguments'] | tojson }}{{ '}</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _training_corpus(seed: int, n_lines: int = 3000) -> list[str]:
    """Text the tokenizer is trained on: arithmetic, chat turns and plain English."""
    rng = random.Random(seed)
    words = (
        "the a of to and in is it you that he was for on are with as I his they be at one "
        "have this from or had by word but what some we can out other were all there when "
        "up use your how said an each she which do their time if will way about many then "
        "them write would like so these her long make thing see him two has look more day "
        "could go come did number sound no most people my over know water than call first "
        "who may down side been now find answer question correct wrong try again think step "
        "sum plus minus times equals result final reward problem solve compute add subtract"
    ).split()
    lines = []
    for _ in range(n_lines):
        kind = rng.random()
        if kind < 0.4:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice("+-*")
            lines.append(f"What is {a} {op} {b}? The answer is \\boxed{{{eval(f'{a}{op}{b}')}}}.")
        elif kind < 0.6:
            lines.append(f"#### {rng.randint(-500, 5000)}")
        else:
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 14))) + ".")
    return lines


# Qwen2's pre-tokenizer split (digits one by one, letters with one leading
# non-letter, runs of punctuation, newlines, spaces).
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def build_tokenizer(vocab_size: int, seed: int = 0, extra_corpus: list[str] | None = None):
    """Train a byte-level BPE tokenizer with Qwen2's normalizer and pre-tokenizer.

    transformers loads every ``model_type: qwen2`` directory with its own
    ``Qwen2Tokenizer``, which rebuilds the normalizer (NFC) and pre-tokenizer
    from code and ignores those in ``tokenizer.json``. Training with exactly
    that pipeline keeps ``AutoTokenizer`` and the raw ``tokenizer.json`` (what
    any other engine reads) in agreement on every string. ``extra_corpus``: more lines to
    train on (a task's own vocabulary, e.g. tool-call markup, then gets merges of its own).
    """
    from tokenizers import (
        Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers,
    )

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(seed) + list(extra_corpus or []), trainer=trainer)
    return tok


def build_tiny_model(
    out_dir: str | os.PathLike,
    size: str = "small",
    seed: int = 0,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = True,
    extra_corpus: list[str] | None = None,
    **overrides: int,
) -> Path:
    """Write a Hugging Face model directory and return its path.

    ``size`` is one of ``SIZES``; ``overrides`` change single config values
    (e.g. ``num_hidden_layers=1``). Weights are deterministic for ``seed``.
    ``extra_corpus``: lines the tokenizer is also trained on (see `build_tokenizer`).
    """
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    named = {**SIZES, **MOE_SIZES}
    if size not in named:
        raise ValueError(f"size={size!r} is not one of {sorted(named)}")
    dims = {**named[size], **overrides}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    raw = build_tokenizer(dims["vocab_size"], seed=seed, extra_corpus=extra_corpus)
    vocab_size = raw.get_vocab_size()  # may be below the target on a small corpus
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        model_max_length=max_position_embeddings,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(out)
    # Keep the tokenizer class generic so that no library rebuilds it from a
    # model type: what we trained is exactly what loads.
    cfg_path = out / "tokenizer_config.json"
    tcfg = json.loads(cfg_path.read_text())
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tcfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(tcfg, indent=2))

    common = dict(
        vocab_size=vocab_size, max_position_embeddings=max_position_embeddings, rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=None, eos_token_id=raw.token_to_id(EOS_TOKEN),
        pad_token_id=raw.token_to_id(PAD_TOKEN), torch_dtype="float32",
    )
    config = _model_config(size, dims, common)
    gen = torch.random.fork_rng(devices=[])
    with gen:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)
    return out


def _model_config(size: str, dims: dict[str, int], common: dict):
    """The transformers config of a named size: Qwen2 (dense) or Qwen3-MoE (``moe-*``)."""
    from transformers import Qwen2Config, Qwen3MoeConfig

    dims = {k: v for k, v in dims.items() if k != "vocab_size"}  # the trained tokenizer's is used
    if size in MOE_SIZES:
        # No shared dense layers; every layer routes. The load-balancing loss stays off by
        # default for RL (output_router_logits False), as the peers run it.
        return Qwen3MoeConfig(**dims, intermediate_size=4 * dims["hidden_size"], decoder_sparse_step=1,
                              mlp_only_layers=[], norm_topk_prob=True, output_router_logits=False,
                              router_aux_loss_coef=0.001, **common)
    return Qwen2Config(**dims, **common)


def n_parameters(model_dir: str | os.PathLike) -> int:
    """Parameter count of a saved model (tied weights counted once)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        for k in f.keys():
            total += _prod(f.get_slice(k).get_shape())
    return total


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--size", default="small", choices=sorted(SIZES) + sorted(MOE_SIZES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    p.add_argument("--untied", action="store_true", help="separate input and output embeddings")
    args = p.parse_args(argv)
    out = build_tiny_model(
        args.out_dir, size=args.size, seed=args.seed,
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=not args.untied,
    )
    print(f"wrote {out} ({n_parameters(out) / 1e6:.2f}M parameters)")


if __name__ == "__main__":
    main()
