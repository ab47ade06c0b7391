"""Packed attention (`arealite.train_engine.attention`): every implementation that runs here
equals a per-sequence Hugging Face forward (each sequence alone, unpacked), forward and
gradients, on packed rows of unequal lengths with GQA; `auto` and the refusals.

The CUDA-only `varlen` path (and `flex` compiled on CUDA) is checked by the `gpu` tests at the
end (`bash ci/gpu_local.sh` runs them on a GPU).
"""

from __future__ import annotations

import copy

import pytest
import torch

from arealite.config.schema import ActorConfig
from arealite.train_engine import attention
from arealite.train_engine.attention import (
    ATTENTION_NAMES,
    ATTN_IMPLS,
    document_causal_block_mask,
    register_attention,
    resolve_attn_impl,
)
from arealite.train_engine.fsdp import FSDPEngine

#: Unequal lengths: length-1 sequences, runs of equal lengths (one batched SDPA call each in
#: sdpa_loop), and one long sequence.
LENGTHS = [1, 7, 33, 1, 5, 5, 5, 150, 2, 1, 12]
CPU_IMPLS = ["sdpa_loop", "flex"]


class _Module(torch.nn.Module):
    training = False


def _reference(q, k, v, lens, scale, window=None):
    """Explicit causal softmax attention of each sequence alone (KV heads repeated), within a
    sliding window of ``window`` tokens (itself included) when one is given."""
    H, KV = q.shape[1], k.shape[1]
    outs, a = [], 0
    for n in lens:
        b = a + n
        kk, vv = k[:, :, a:b].repeat_interleave(H // KV, 1), v[:, :, a:b].repeat_interleave(H // KV, 1)
        scores = q[:, :, a:b] @ kk.transpose(-1, -2) * scale
        allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
        if window is not None:
            allowed &= ~torch.tril(torch.ones(n, n, dtype=torch.bool), diagonal=-window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append((scores.softmax(-1) @ vv).transpose(1, 2))
        a = b
    return torch.cat(outs, dim=1)


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_kernel_equals_separate_sequences_with_gradients(impl):
    torch.manual_seed(0)
    H, KV, D = 4, 2, 8
    lens = [5, 1, 3, 3, 3, 7]
    T = sum(lens)
    q = torch.randn(1, H, T, D, requires_grad=True)
    k = torch.randn(1, KV, T, D, requires_grad=True)
    v = torch.randn(1, KV, T, D, requires_grad=True)
    fn = attention._FUNCTIONS[impl]
    out, _ = fn(_Module(), q, k, v, None, scaling=0.3, cu_seq_lens_q=_cu(lens))
    assert out.shape == (1, T, H, D)
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref = _reference(q, k, v, lens, 0.3)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    assert (out - ref).abs().max().item() <= 1e-6
    for g, rg in zip(grads, ref_grads):
        assert (g - rg).abs().max().item() <= 1e-5
    # Without boundaries the row is one causal sequence.
    whole, _ = fn(_Module(), q, k, v, None, scaling=0.3)
    assert (whole - _reference(q, k, v, [T], 0.3)).abs().max().item() <= 1e-6
    with pytest.raises(ValueError, match="not an attention mask"):
        fn(_Module(), q, k, v, torch.ones(1, 1, T, T, dtype=torch.bool))


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_kernel_keeps_the_sliding_window_the_layer_passes(impl):
    """``sliding_window=3``: each token sees itself and the 2 before it in its sequence, in
    sequences longer and shorter than the window, forward and gradients."""
    torch.manual_seed(0)
    H, KV, D, W = 4, 2, 8, 3
    lens = [5, 1, 3, 3, 3, 7]
    T = sum(lens)
    q, k, v = (torch.randn(1, h, T, D, requires_grad=True) for h in (H, KV, KV))
    out, _ = attention._FUNCTIONS[impl](_Module(), q, k, v, None, scaling=0.3, cu_seq_lens_q=_cu(lens),
                                        sliding_window=W)
    ref = _reference(q, k, v, lens, 0.3, window=W)
    assert (out - ref).abs().max().item() <= 1e-6
    assert (ref - _reference(q, k, v, lens, 0.3)).abs().max().item() > 1e-2  # the window matters here
    w = torch.randn_like(out)
    for g, rg in zip(torch.autograd.grad((out * w).sum(), (q, k, v)), torch.autograd.grad((ref * w).sum(), (q, k, v))):
        assert (g - rg).abs().max().item() <= 1e-5


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_packed_model_keeps_the_models_sliding_window(impl, family):
    """A Mistral (every layer windowed) and a Qwen2 with ``use_sliding_window`` (windowed layers
    above ``max_window_layers``) packed as the trainer packs them equal transformers' own forward
    of each sequence alone, for sequences longer than the window (the packed kernels ignored
    the window before, a silent mismatch with the servers on long rows)."""
    from transformers import MistralConfig, Qwen2Config

    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=97, max_position_embeddings=256, tie_word_embeddings=False)
    if family == "mistral":
        cfg = MistralConfig(**common, sliding_window=4)
    else:
        cfg = Qwen2Config(**common, use_sliding_window=True, sliding_window=4, max_window_layers=1)
        assert cfg.layer_types == ["full_attention", "sliding_attention"]
    ref, packed = _models(impl, cfg)
    lens = [9, 3, 12]
    ids = torch.randint(0, 97, (sum(lens),), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad():
        logits = packed(input_ids=ids[None], position_ids=pos[None], cu_seq_lens_q=_cu(lens), use_cache=False).logits[0]
        want = torch.cat([ref(input_ids=part[None], use_cache=False).logits[0] for part in ids.split(lens)])
    assert (logits - want).abs().max().item() <= 1e-5


def test_sdpa_loop_rejects_boundaries_that_do_not_cover_the_row():
    q = torch.randn(1, 2, 22, 4)
    with pytest.raises(ValueError, match="ends at 21"):
        attention.sdpa_loop_attention(_Module(), q, q, q, None, cu_seq_lens_q=torch.tensor([0, 21]))


def test_document_causal_block_mask_is_the_definition():
    lens = [3, 1, 4, 0, 2]
    mask = document_causal_block_mask(_cu(lens), sum(lens), torch.device("cpu"))
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    want = (doc[:, None] == doc[None, :]) & torch.tril(torch.ones(10, 10, dtype=torch.bool))
    got = mask.mask_mod(0, 0, torch.arange(10)[:, None], torch.arange(10)[None, :])
    assert torch.equal(got, want)


def _tiny_qwen2():
    from transformers import Qwen2Config

    # GQA: 4 query heads share 2 KV heads.
    return Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=97, max_position_embeddings=256,
                       attention_dropout=0.0, tie_word_embeddings=False)


def _models(impl, cfg=None):
    """transformers' SDPA model of ``cfg`` (the tiny Qwen2 by default) and the same weights with
    the packed attention ``impl``, both in train mode."""
    from transformers import AutoModelForCausalLM

    cfg = cfg or _tiny_qwen2()
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    # A config of its own: from_config keeps the object, and setting the packed model's attention
    # on a shared one would switch the reference's too.
    packed = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=register_attention(impl),
                                              dtype=torch.float32)
    assert ref.config._attn_implementation == "sdpa"
    packed.load_state_dict(ref.state_dict())
    return ref.train(), packed.train()


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_packed_model_equals_per_sequence_hf_forward_and_gradients(impl):
    ref, packed = _models(impl)
    g = torch.Generator().manual_seed(1)
    T = sum(LENGTHS)
    ids = torch.randint(0, 97, (T,), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])
    w = torch.randn(T, 97, generator=g)

    logits = packed(input_ids=ids[None], position_ids=pos[None], cu_seq_lens_q=_cu(LENGTHS), use_cache=False).logits[0]
    (logits * w).sum().div(T).backward()  # a token-mean loss, as training uses

    ref_logits, a = [], 0
    for n in LENGTHS:
        ref_logits.append(ref(input_ids=ids[None, a:a + n], use_cache=False).logits[0])
        a += n
    ref_logits = torch.cat(ref_logits)
    (ref_logits * w).sum().div(T).backward()

    assert (logits - ref_logits).abs().max().item() <= 1e-5
    ref_params = dict(ref.named_parameters())
    for name, p in packed.named_parameters():
        err = (p.grad - ref_params[name].grad).abs().max().item()
        assert err <= 1e-5, (impl, name, err)


def test_flex_block_mask_is_built_once_per_micro_batch(monkeypatch):
    _, packed = _models("flex")
    builds = []
    build = attention.document_causal_block_mask
    monkeypatch.setattr(attention, "_flex_masks", {})
    monkeypatch.setattr(attention, "document_causal_block_mask", lambda *a, **kw: builds.append(a) or build(*a, **kw))
    for lens in ([4, 9, 1], [2, 2, 6]):
        ids = torch.randint(0, 97, (1, sum(lens)))
        pos = torch.cat([torch.arange(n) for n in lens])[None]
        packed(input_ids=ids, position_ids=pos, cu_seq_lens_q=_cu(lens), use_cache=False).logits.sum().backward()
    assert len(builds) == 2  # two layers each, one mask per micro-batch


def test_auto_resolves_to_an_implementation_that_runs():
    assert set(ATTN_IMPLS) == {"auto", *ATTENTION_NAMES}
    assert resolve_attn_impl("auto", "cpu", torch.float32) == "sdpa_loop"
    assert resolve_attn_impl("auto", "cuda", torch.float32) == "sdpa_loop"  # FlashAttention needs bf16/fp16
    assert resolve_attn_impl("auto", "cuda", torch.bfloat16) in ("varlen", "sdpa_loop")
    for impl in CPU_IMPLS:
        assert resolve_attn_impl(impl, "cpu", torch.float32) == impl
    with pytest.raises(ValueError, match=r"actor\.attn_impl='bogus'"):
        resolve_attn_impl("bogus", "cpu", torch.float32)


def test_varlen_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match=r"actor\.attn_impl=varlen cannot run here: .* runs on cpu"):
        resolve_attn_impl("varlen", "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"actor\.attn_impl=varlen cannot run here: .*bfloat16"):
        resolve_attn_impl("varlen", "cuda", torch.float32)


@pytest.mark.parametrize("section", ["actor", "critic"])
def test_engine_refuses_varlen_on_cpu_naming_the_field(micro_model_dir, section):
    from arealite.critic import ValueEngine

    cfg = ActorConfig(model_path=str(micro_model_dir), attn_impl="varlen")
    engine = FSDPEngine(cfg, device="cpu") if section == "actor" else ValueEngine(cfg, device="cpu")
    try:
        with pytest.raises(ValueError, match=rf"{section}\.attn_impl=varlen cannot run here"):
            engine.initialize()
    finally:
        engine.destroy()


def test_engine_with_flex_trains_as_with_sdpa_loop(micro_model_dir):
    from test_fsdp import LENGTHS as ENGINE_LENGTHS
    from test_fsdp import full_grads, make_batch, n_tokens, token_mean_ce

    results = {}
    for impl in ("auto", "flex"):
        cfg = ActorConfig(model_path=str(micro_model_dir), mb_max_tokens=24, attn_impl=impl)
        cfg.optimizer.gradient_clipping = 0.0
        engine = FSDPEngine(cfg, device="cpu").initialize()
        try:
            assert engine.model.config._attn_implementation == ATTENTION_NAMES["sdpa_loop" if impl == "auto" else impl]
            batch = make_batch(engine.hf_config.vocab_size, ENGINE_LENGTHS)
            stats = engine.train_batch(batch, token_mean_ce, n_tokens)
            results[impl] = (stats["loss"], full_grads(engine))
        finally:
            engine.destroy()
    assert abs(results["auto"][0] - results["flex"][0]) <= 1e-5
    for name, g in results["auto"][1].items():
        assert (g - results["flex"][1][name]).abs().max().item() <= 1e-5, name


# ---------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["varlen", "flex"])
def test_cuda_packed_attention_equals_per_sequence_sdpa(impl):
    """bf16 on the GPU: the packed kernel against SDPA run on each sequence alone (same dtype),
    forward and input gradients, with GQA and the boundaries never read back per layer."""
    torch.manual_seed(0)
    H, KV, D = 8, 2, 64
    lens = [1, 37, 300, 5, 5, 5, 1, 1200, 2]
    T = sum(lens)
    dev = torch.device("cuda")
    q = torch.randn(1, H, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, KV, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, KV, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    cu = _cu(lens).to(dev)
    assert resolve_attn_impl(impl, "cuda", torch.bfloat16) == impl
    out, _ = attention._FUNCTIONS[impl](_Module(), q, k, v, None, scaling=D ** -0.5, cu_seq_lens_q=cu,
                                        max_length_q=max(lens))
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
    ref, a = [], 0
    # The reference is SDPA's math backend: on torch 2.11 (H200) a fused SDPA backward gave NaN
    # and 1e27 gradients for this batch once the flex kernel had run before it.
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        for n in lens:
            o = torch.nn.functional.scaled_dot_product_attention(q[:, :, a:a + n], k[:, :, a:a + n],
                                                                 v[:, :, a:a + n], is_causal=True, enable_gqa=True)
            ref.append(o.transpose(1, 2))
            a += n
    ref = torch.cat(ref, dim=1)
    ref_grads = torch.autograd.grad((ref.float() * w).sum(), (q, k, v))
    assert (out.float() - ref.float()).abs().max().item() <= 2e-2
    for g, rg in zip(grads, ref_grads):
        assert (g.float() - rg.float()).abs().max().item() <= 5e-2 * max(1.0, rg.float().abs().max().item())
