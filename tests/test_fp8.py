"""Block-wise FP8 weights (arealite/quant/fp8.py) against the definition.

The reference below quantises tile by tile with plain loops: scale = amax/448 per 128x128
tile (edge tiles partial), stored value = the e4m3 number nearest to w/scale.

Error bound used: e4m3 has 3 mantissa bits, so round-to-nearest of a normal value y is off
by at most half a unit in the last place, |y| * 2^-4; below the smallest normal (2^-6) the
spacing is the subnormal step 2^-9, so the error is at most 2^-10. In weight units, one
element's error is at most 2^-4 |w| + 2^-10 * scale, hence at most amax/16 in its tile
(tighter than the 2^-3 of amax that a full ulp would allow).
"""

from __future__ import annotations

import math

import pytest
import torch

from arealite.quant.fp8 import (FP8_DTYPE, FP8_MAX, dequantize_blockwise, fp8_checkpoint_tensors,
                                quantize_blockwise, stays_unquantised)

#: Every finite float8_e4m3fn value, for checking "nearest" from the definition.
_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
_E4M3_VALUES = _E4M3_VALUES[torch.isfinite(_E4M3_VALUES)].unique()


def reference_quantize(w: torch.Tensor, block: int = 128):
    out, inp = w.shape
    rows_b, cols_b = math.ceil(out / block), math.ceil(inp / block)
    q = torch.empty(out, inp, dtype=FP8_DTYPE)
    scale = torch.empty(rows_b, cols_b, dtype=torch.float32)
    for i in range(rows_b):
        for j in range(cols_b):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            amax = tile.abs().max().item()
            s = amax / 448.0 if amax > 0 else 1.0
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / s).to(FP8_DTYPE)
    return q, scale


def reference_dequantize(q: torch.Tensor, scale: torch.Tensor, block: int = 128):
    w = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            w[rows, cols] = q[rows, cols].float() * scale[i, j]
    return w


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (1, 129), (127, 5)])
def test_matches_reference_and_stays_within_e4m3_bound(shape):
    torch.manual_seed(0)
    # Tiles of very different magnitudes, so a scale mixed up between tiles shows.
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[1])
    q, scale_inv = quantize_blockwise(w)
    ref_q, ref_scale = reference_quantize(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert scale_inv.dtype == torch.float32
    assert scale_inv.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    torch.testing.assert_close(scale_inv, ref_scale, rtol=1e-6, atol=0)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))

    back = dequantize_blockwise(q, scale_inv)
    torch.testing.assert_close(back, reference_dequantize(ref_q, ref_scale), rtol=1e-6, atol=0)
    scale_full = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    bound = w.abs() * 2.0**-4 + scale_full * 2.0**-10
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()
    assert ((back - w).abs() <= scale_full * FP8_MAX / 16).all()  # amax/16 per tile


def test_each_value_is_the_nearest_e4m3_number():
    torch.manual_seed(1)
    w = torch.randn(130, 140)
    q, scale_inv = quantize_blockwise(w)
    scaled = w / scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:130, :140]
    nearest_gap = (scaled.reshape(-1, 1) - _E4M3_VALUES).abs().min(dim=1).values
    chosen_gap = (scaled.reshape(-1) - q.float().reshape(-1)).abs()
    assert torch.allclose(chosen_gap, nearest_gap, rtol=0, atol=1e-6)
    # The largest |value| of every tile lands on +-448 exactly.
    assert q.float().abs().max().item() == FP8_MAX


def test_an_all_zero_tile_gets_a_usable_scale():
    w = torch.randn(256, 256)
    w[:128, 128:] = 0.0
    q, scale_inv = quantize_blockwise(w)
    assert torch.isfinite(scale_inv).all() and (scale_inv > 0).all()
    back = dequantize_blockwise(q, scale_inv)
    assert torch.isfinite(back).all()
    assert (back[:128, 128:] == 0).all()


def test_bf16_in_and_out():
    w = torch.randn(200, 130, dtype=torch.bfloat16)
    q, scale_inv = quantize_blockwise(w)
    back = dequantize_blockwise(q, scale_inv, dtype=torch.bfloat16)
    assert back.dtype == torch.bfloat16 and back.shape == w.shape
    ref_q, _ = reference_quantize(w)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="2-D"):
        quantize_blockwise(torch.randn(8))
    q, scale_inv = quantize_blockwise(torch.randn(200, 200))
    with pytest.raises(ValueError, match=r"needs \(2, 2\)"):
        dequantize_blockwise(q, scale_inv[:1])


def test_checkpoint_names_and_what_stays_unquantised():
    hidden, vocab, experts = 64, 100, 4
    params = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden),
        "lm_head.weight": torch.randn(vocab, hidden),
        "model.norm.weight": torch.randn(hidden),
        "model.layers.0.input_layernorm.weight": torch.randn(hidden),
        "model.layers.0.self_attn.q_norm.weight": torch.randn(16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(hidden, hidden),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(hidden),
        "model.layers.0.mlp.gate.weight": torch.randn(experts, hidden),
        "model.layers.0.mlp.shared_expert_gate.weight": torch.randn(1, hidden),
        "model.layers.0.mlp.experts.1.gate_proj.weight": torch.randn(32, hidden),
        "model.layers.1.mlp.gate_proj.weight": torch.randn(32, hidden),
        "model.layers.1.mlp.down_proj.weight": torch.randn(hidden, 32),
    }
    sent = {}
    for name, w in params.items():
        sent.update(dict(fp8_checkpoint_tensors(name, w)))
    quantised = {"model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.mlp.experts.1.gate_proj.weight",
                 "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.down_proj.weight"}
    assert set(sent) == set(params) | {n + "_scale_inv" for n in quantised}
    for name, w in params.items():
        if name in quantised:
            assert sent[name].dtype == FP8_DTYPE and not stays_unquantised(name, w)
            assert sent[name + "_scale_inv"].shape == (1, 1)
        else:
            assert sent[name] is w and stays_unquantised(name, w)
