"""The tiny offline model: a real Hugging Face directory that loads like any hub model."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from arealite.models.tiny import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    IM_END,
    IM_START,
    PAD_TOKEN,
    SIZES,
    build_tiny_model,
    n_parameters,
)

REPO = Path(__file__).resolve().parents[1]


def random_texts(n: int, seed: int = 0) -> list[str]:
    """Strings mixing digits, spaces, newlines, punctuation, unicode and special tokens."""
    rng = random.Random(seed)
    pieces = (
        list("0123456789") + [" ", "  ", "\n", "\n\n", "\t", "\r\n"]
        + list("abcxyzABCXYZ.,;:!?+-*/=()[]{}'\"#$%\\_")
        + ["the", " answer", " is", "What", "\\boxed{", "}", "####", "'s", "'LL", " 12345"]
        + ["é", "e\u0301", "ß", "中文", "日本", "🙂", "👍🏽", "\u00a0", "\u200b", "Ω", "ﬁ"]
        + [PAD_TOKEN, EOS_TOKEN, IM_START, IM_END, f" {IM_END} ", f"{IM_START}user\n", "<|not_special|>"]
    )
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 24))) for _ in range(n)]


@pytest.fixture(scope="module", params=["micro", "small"])
def model_dir(request) -> Path:
    return request.getfixturevalue(f"{request.param}_model_dir" if request.param == "micro" else "tiny_model_dir")


def test_loads_offline_with_auto_classes(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen2"
    assert model.config.vocab_size == len(tok) == tok.backend_tokenizer.get_vocab_size()
    assert tok.eos_token == EOS_TOKEN and model.config.eos_token_id == tok.eos_token_id
    assert tok.pad_token == PAD_TOKEN and model.config.pad_token_id == tok.pad_token_id
    assert tok.bos_token is None  # nothing is prepended to prompts
    # The loaded weights are the saved ones (tied lm_head included).
    saved = load_file(str(model_dir / "model.safetensors"))
    params = dict(model.named_parameters())
    for name, tensor in saved.items():
        assert torch.equal(params[name], tensor), name
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    ids = tok("What is 12 + 7?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] <= ids.shape[1] + 3 and torch.equal(out[0, : ids.shape[1]], ids[0])


def test_auto_tokenizer_matches_raw_tokenizer_json(model_dir):
    """AutoTokenizer (transformers' Qwen2Tokenizer) and tokenizer.json give the same ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    texts = random_texts(400)
    for text in texts:
        ids = raw.encode(text, add_special_tokens=False).ids
        assert tok.encode(text, add_special_tokens=False) == ids, repr(text)
        assert tok(text)["input_ids"] == raw.encode(text).ids, repr(text)
        # Decoding gives the text back, up to the NFC normalisation Qwen2 applies.
        assert tok.decode(ids) == unicodedata.normalize("NFC", text), repr(text)
        assert raw.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)
    batch = tok(texts[:16])["input_ids"]
    assert batch == [raw.encode(t).ids for t in texts[:16]]
    for special in (PAD_TOKEN, EOS_TOKEN, IM_START, IM_END):
        assert tok.encode(special, add_special_tokens=False) == [raw.token_to_id(special)]
    assert tok.decode(tok.encode(f"a{IM_END}b"), skip_special_tokens=True) == "ab"
    # Digits are single tokens: arithmetic rewards depend on it.
    digits = tok.encode("9876543210", add_special_tokens=False)
    assert [tok.decode([i]) for i in digits] == list("9876543210")


def test_chat_template_renders(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "system", "content": "Reverse the digits."},
        {"role": "user", "content": "1234"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nReverse the digits.<|im_end|>\n"
        "<|im_start|>user\n1234<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert text.startswith(no_prompt) and not no_prompt.endswith("assistant\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.convert_tokens_to_ids(IM_START)) == 3
    assert json.loads((tiny_model_dir / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE


def test_weights_and_tokenizer_are_deterministic_for_a_seed(tmp_path):
    a = build_tiny_model(tmp_path / "a", size="micro", seed=3)
    b = build_tiny_model(tmp_path / "b", size="micro", seed=3)
    c = build_tiny_model(tmp_path / "c", size="micro", seed=4)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    wa, wc = load_file(str(a / "model.safetensors")), load_file(str(c / "model.safetensors"))
    # Random matrices differ; biases (zeros) and norms (ones) start equal by design.
    shared = [k for k in wa if k in wc and wa[k].shape == wc[k].shape and k.endswith("proj.weight")]
    assert shared and all(not torch.equal(wa[k], wc[k]) for k in shared)
    # The global RNG is left alone: building a model does not reseed the caller.
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "d", size="micro", seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_parameter_counts_span_the_named_sizes(tmp_path, micro_model_dir, tiny_model_dir):
    counts = {
        "micro": n_parameters(micro_model_dir),
        "small": n_parameters(tiny_model_dir),
        "base": n_parameters(build_tiny_model(tmp_path / "base", size="base")),
        "large": n_parameters(build_tiny_model(tmp_path / "large", size="large")),
    }
    assert list(counts) == list(SIZES)
    assert 0.05e6 <= counts["micro"] <= 0.2e6
    assert 0.5e6 <= counts["small"] <= 2e6
    assert 5e6 <= counts["base"] <= 20e6
    assert 30e6 <= counts["large"] <= 80e6
    # n_parameters (read from the file, tied weights once) agrees with the model.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    assert counts["base"] == sum(p.numel() for p in model.parameters())
    for name in ("base", "large"):
        # The model's vocabulary is exactly the trained tokenizer's (the small
        # local corpus may stop BPE short of the target size).
        cfg = json.loads((tmp_path / name / "config.json").read_text())
        raw = Tokenizer.from_file(str(tmp_path / name / "tokenizer.json"))
        assert cfg["vocab_size"] == raw.get_vocab_size() <= SIZES[name]["vocab_size"]


def test_overrides_and_untied_embeddings(tmp_path):
    tied = build_tiny_model(tmp_path / "t", size="micro", num_hidden_layers=1)
    untied = build_tiny_model(tmp_path / "u", size="micro", num_hidden_layers=1, tie_word_embeddings=False)
    cfg = json.loads((tied / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is True
    assert "lm_head.weight" in load_file(str(untied / "model.safetensors"))
    vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
    assert n_parameters(untied) - n_parameters(tied) == vocab * hidden
    with pytest.raises(ValueError, match="size='huge'"):
        build_tiny_model(tmp_path / "x", size="huge")


def test_cli_builds_a_model(tmp_path):
    out = tmp_path / "cli_model"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(
        [sys.executable, "-m", "arealite.models.tiny", str(out), "--size", "micro", "--seed", "5"],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    assert f"wrote {out}" in r.stdout
    assert f"({n_parameters(out) / 1e6:.2f}M parameters)" in r.stdout
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    same = build_tiny_model(tmp_path / "same", size="micro", seed=5)
    assert (out / "model.safetensors").read_bytes() == (same / "model.safetensors").read_bytes()
    bad = subprocess.run(
        [sys.executable, "-m", "arealite.models.tiny", str(tmp_path / "y"), "--size", "huge"],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO,
    )
    assert bad.returncode == 2 and "invalid choice: 'huge'" in bad.stderr
