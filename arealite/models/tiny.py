"""Build a tiny but real Hugging Face model directory, offline.

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
    python -m arealite.models.tiny OUT_DIR --size vl-micro    # Qwen2.5-VL, vision tower + processor

A ``vl-*`` size writes a vision-language model (``Qwen2_5_VLForConditionalGeneration``) with
its processor (a Qwen2-VL image processor and the tokenizer extended with the image tokens)
and a chat template that renders image content parts; it loads with ``AutoProcessor`` and
``AutoModelForImageTextToText`` (docs/vision.md).
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

#: The dense decoder families a ``SIZES`` size can be built as: their transformers config classes.
DENSE_FAMILIES: dict[str, str] = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                                  "llama": "LlamaConfig", "mistral": "MistralConfig"}

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
    # ~10M, shaped like the real MoEs (many layers, top-8 of 64 narrow experts): bench_moe.
    "moe-wide": dict(hidden_size=128, num_hidden_layers=24, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=16,
                     vocab_size=512),
}

#: Named vision-language sizes (``Qwen2_5_VLForConditionalGeneration``): the text decoder's
#: dimensions as above, and the vision tower's under ``vision_*`` (patch 14, 2x2 merge, as the
#: real model; images are resized to at most ``max_pixels`` so a CPU forward stays cheap).
VL_SIZES: dict[str, dict[str, int]] = {
    # ~0.2M parameters: unit tests and the vision demo.
    "vl-micro": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, vocab_size=512, vision_depth=2, vision_hidden_size=32,
                     vision_num_heads=2, vision_intermediate_size=64),
    # ~1.2M: a larger vision model.
    "vl-small": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=384, vocab_size=512, vision_depth=4, vision_hidden_size=64,
                     vision_num_heads=4, vision_intermediate_size=128),
}

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, IM_START, IM_END]
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
#: Added to the tokenizer of a ``vl-*`` size (the names Qwen2.5-VL's processor and SGLang use).
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
#: The image processor's pixel bounds for the tiny VLM: 56x56 (4 merged tokens) to 112x112 (16).
VL_MIN_PIXELS = 56 * 56
VL_MAX_PIXELS = 112 * 112

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

# The vision-language template: the same turns, where a message's content may also be a list of
# parts, `{"type": "text", "text": ...}` or `{"type": "image", ...}` (`image_url` too); an image part
# renders as `<|vision_start|><|image_pad|><|vision_end|>`, which the processor expands to one
# `<|image_pad|>` per merged patch, as Qwen2.5-VL's own template does.
VL_CHAT_TEMPLATE = (
    "{% macro render(content) %}{% if content is string %}{{ content }}{% else %}"
    "{% for part in content or [] %}"
    "{% if part['type'] in ['image', 'image_url'] %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endmacro %}"
    + CHAT_TEMPLATE.replace("(message['content'] or '')", "render(message['content'])")
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


def build_tokenizer(vocab_size: int, seed: int = 0, extra_corpus: list[str] | None = None,
                    special_tokens: list[str] | None = None):
    """Train a byte-level BPE tokenizer with Qwen2's normalizer and pre-tokenizer.

    transformers loads every ``model_type: qwen2`` directory with its own
    ``Qwen2Tokenizer``, which rebuilds the normalizer (NFC) and pre-tokenizer
    from code and ignores those in ``tokenizer.json``. Training with exactly
    that pipeline keeps ``AutoTokenizer`` and the raw ``tokenizer.json`` (what
    any other engine reads) in agreement on every string. ``extra_corpus``: more lines to
    train on (a task's own vocabulary, e.g. tool-call markup, then gets merges of its own).
    ``special_tokens``: replaces `SPECIAL_TOKENS` (the vision sizes add `VISION_TOKENS`).
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
        special_tokens=special_tokens or SPECIAL_TOKENS,
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
    family: str = "qwen2",
    **overrides: int | bool,
) -> Path:
    """Write a Hugging Face model directory and return its path.

    ``size`` is one of ``SIZES``; ``overrides`` change single config values
    (e.g. ``num_hidden_layers=1``). Weights are deterministic for ``seed``.
    ``extra_corpus``: lines the tokenizer is also trained on (see `build_tokenizer`).
    ``family``: the dense decoder a ``SIZES`` size is built as (`DENSE_FAMILIES`): Qwen2 by
    default; Qwen3 normalises each query and key head, Llama and Mistral take
    ``attention_bias`` / ``mlp_bias`` overrides; the parallel layouts are checked on each.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    named = {**SIZES, **MOE_SIZES, **VL_SIZES}
    if size not in named:
        raise ValueError(f"size={size!r} is not one of {sorted(named)}")
    if family not in DENSE_FAMILIES or (family != "qwen2" and size not in SIZES):
        raise ValueError(f"family={family!r}: a dense size ({sorted(SIZES)}) is built as one of "
                         f"{sorted(DENSE_FAMILIES)}; the moe-* and vl-* sizes have their own family")
    dims = {**named[size], **overrides}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    vision = size in VL_SIZES
    raw = build_tokenizer(dims["vocab_size"], seed=seed, extra_corpus=extra_corpus,
                          special_tokens=SPECIAL_TOKENS + VISION_TOKENS if vision else None)
    hf_tok = _save_tokenizer(raw, out, max_position_embeddings, VL_CHAT_TEMPLATE if vision else CHAT_TEMPLATE)
    if vision:
        _save_processor(hf_tok, out)

    common = dict(
        vocab_size=raw.get_vocab_size(),  # may be below the target on a small corpus
        max_position_embeddings=max_position_embeddings, rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=None, eos_token_id=raw.token_to_id(EOS_TOKEN),
        pad_token_id=raw.token_to_id(PAD_TOKEN), torch_dtype="float32",
    )
    if vision:
        config = _vl_config(dims, common, {t: raw.token_to_id(t) for t in VISION_TOKENS})
    else:
        config = _model_config(size, dims, common, family)
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    gen = torch.random.fork_rng(devices=[])
    with gen:
        torch.manual_seed(seed)
        model = auto.from_config(config)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)
    return out


def _save_tokenizer(raw, out: Path, max_length: int, chat_template: str):
    """Save the trained tokenizer as a transformers fast tokenizer with ``chat_template``."""
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        model_max_length=max_length,
    )
    hf_tok.chat_template = chat_template
    hf_tok.save_pretrained(out)
    # Keep the tokenizer class generic so that no library rebuilds it from a
    # model type: what we trained is exactly what loads.
    cfg_path = out / "tokenizer_config.json"
    tcfg = json.loads(cfg_path.read_text())
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tcfg["chat_template"] = chat_template
    cfg_path.write_text(json.dumps(tcfg, indent=2))
    return hf_tok


def _save_processor(hf_tok, out: Path) -> None:
    """Write the Qwen2.5-VL processor beside the tokenizer: a Qwen2-VL image processor (patch 14,
    2x2 merge, pixels bounded by `VL_MIN_PIXELS`/`VL_MAX_PIXELS`) and the VL chat template, in
    the files a hub checkpoint has (``preprocessor_config.json``, ``processor_config.json``)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from arealite.vision.processor import ImageOnlyQwen2_5_VLProcessor

    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": VL_MIN_PIXELS, "longest_edge": VL_MAX_PIXELS},
        patch_size=14, temporal_patch_size=2, merge_size=2,
    )
    # Saved through the processor class without its video part (that one needs torchvision,
    # absent on CPU machines), then named as the stock class so AutoProcessor builds that.
    ImageOnlyQwen2_5_VLProcessor(image_processor, hf_tok, chat_template=VL_CHAT_TEMPLATE).save_pretrained(out)
    image_processor.save_pretrained(out)
    pcfg_path = out / "processor_config.json"
    pcfg = json.loads(pcfg_path.read_text())
    pcfg["processor_class"] = "Qwen2_5_VLProcessor"
    pcfg_path.write_text(json.dumps(pcfg, indent=2))
    tcfg_path = out / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text())
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # as `_save_tokenizer` leaves it
    tcfg.pop("processor_class", None)
    tcfg_path.write_text(json.dumps(tcfg, indent=2))


def _model_config(size: str, dims: dict[str, int], common: dict, family: str):
    """The transformers config of a named size: a dense ``family`` (`DENSE_FAMILIES`) or
    Qwen3-MoE (``moe-*``)."""
    import transformers
    from transformers import Qwen3MoeConfig

    dims = {k: v for k, v in dims.items() if k != "vocab_size"}  # the trained tokenizer's is used
    if size in MOE_SIZES:
        # No shared dense layers; every layer routes. The load-balancing loss stays off by
        # default for RL (output_router_logits False), as the peers run it.
        return Qwen3MoeConfig(**dims, intermediate_size=4 * dims["hidden_size"], decoder_sparse_step=1,
                              mlp_only_layers=[], norm_topk_prob=True, output_router_logits=False,
                              router_aux_loss_coef=0.001, **common)
    if family == "qwen3":  # its config defaults head_dim to 128 whatever the width
        dims = {"head_dim": dims["hidden_size"] // dims["num_attention_heads"], **dims}
    return getattr(transformers, DENSE_FAMILIES[family])(**dims, **common)


def _vl_config(dims: dict[str, int], common: dict, token_ids: dict[str, int]):
    """The Qwen2.5-VL config of a ``vl-*`` size: the text decoder with 3-D (mrope) rotary
    sections in Qwen's 1/4, 3/8, 3/8 split of the rotary half, and a small vision tower."""
    from transformers import Qwen2_5_VLConfig

    text = {k: v for k, v in dims.items() if not k.startswith("vision_") and k != "vocab_size"}
    half = text["hidden_size"] // text["num_attention_heads"] // 2
    t = half // 4
    mrope = [t, (half - t) // 2, half - t - (half - t) // 2]
    rope_theta = common.pop("rope_theta")
    tie = common.pop("tie_word_embeddings")
    text_config = dict(**text, **common, rope_parameters={"rope_type": "default", "rope_theta": rope_theta,
                                                          "mrope_section": mrope})
    depth = dims["vision_depth"]
    vision_config = dict(
        depth=depth, hidden_size=dims["vision_hidden_size"], num_heads=dims["vision_num_heads"],
        intermediate_size=dims["vision_intermediate_size"], out_hidden_size=text["hidden_size"],
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
        fullatt_block_indexes=[depth - 1], in_channels=3,
    )
    return Qwen2_5_VLConfig(
        text_config=text_config, vision_config=vision_config, tie_word_embeddings=tie,
        image_token_id=token_ids[IMAGE_PAD], video_token_id=token_ids[VIDEO_PAD],
        vision_start_token_id=token_ids[VISION_START], vision_end_token_id=token_ids[VISION_END],
        eos_token_id=common["eos_token_id"], pad_token_id=common["pad_token_id"],
    )


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
    p.add_argument("--size", default="small", choices=sorted(SIZES) + sorted(MOE_SIZES) + sorted(VL_SIZES))
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
