"""The embedded server with ``--quantization fp8`` (arealite/server/fp8_linear.py).

Its greedy generation must equal, token for token, an HF forward whose linear weights are
the same FP8-rounded ones (de-quantised), before and after a bf16/fp32 update that it
quantises on arrival; its log-probs must match that forward and differ from the
unquantised model's (so the comparison can tell the two apart).
"""

from __future__ import annotations

import pytest
import torch

from arealite.quant.fp8 import FP8_DTYPE, dequantize_blockwise, quantize_blockwise, stays_unquantised
from arealite.server.fp8_linear import quantize_linears
from arealite.server.process import ServerProcess
from arealite.server.weights import check_full_checkpoint, check_metadata, copy_into_model, model_state
from tests.test_server_generate import free_port, http, post, prompt_of  # noqa: F401  (http: the fixture)

pytestmark = pytest.mark.timeout(180)


def _hf(model_dir, fp8: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if fp8:  # the same rounding, kept as an ordinary float32 linear layer
        with torch.no_grad():
            for name, mod in model.named_modules():
                if isinstance(mod, torch.nn.Linear) and not stays_unquantised(f"{name}.weight", mod.weight):
                    mod.weight.copy_(dequantize_blockwise(*quantize_blockwise(mod.weight)))
    return model


def _greedy(model, prompt, n):
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            ids.append(int(logp.argmax()))
            logprobs.append(float(logp[ids[-1]]))
    return ids[len(prompt):], logprobs


@pytest.fixture(scope="module")
def seed1_dir(tmp_path_factory):
    from arealite.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_seed1_fp8"), size="small", seed=1)


@pytest.fixture(scope="module")
def fp8_server(tiny_model_dir, tmp_path_factory, request):
    proc = ServerProcess(tiny_model_dir, free_port(), extra_args=["--quantization", "fp8", "--dtype", "float32"],
                         log_path=tmp_path_factory.mktemp("fp8_server") / "server.log", threads=1)
    request.addfinalizer(proc.stop)  # also when it never gets healthy
    return proc.wait_healthy()


async def _server_greedy(http, server, prompt, n):
    out = await post(http, server, "/generate", {"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
    return out["output_ids"], [lp[0] for lp in out["meta_info"]["output_token_logprobs"]]


async def _check_matches_fp8_forward(http, server, model_dir):
    fp8_model, plain_model = _hf(model_dir, fp8=True), _hf(model_dir, fp8=False)
    gap_to_plain = 0.0
    for seed, length in ((1, 7), (2, 12)):
        prompt = prompt_of(length, seed)
        ids, logprobs = await _server_greedy(http, server, prompt, 10)
        want_ids, want_logprobs = _greedy(fp8_model, prompt, 10)
        assert ids == want_ids
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=2e-4, rtol=0)
        with torch.no_grad():  # the unquantised model scores the same tokens differently
            full = torch.tensor([prompt + ids])
            plain = torch.log_softmax(plain_model(full).logits[0, len(prompt) - 1:-1].float(), -1)
        plain_lp = plain.gather(1, torch.tensor(ids)[:, None])[:, 0]
        gap_to_plain = max(gap_to_plain, float((plain_lp - torch.tensor(logprobs)).abs().max()))
    assert gap_to_plain > 1e-3


async def test_fp8_server_generates_as_the_fp8_rounded_hf_model_before_and_after_an_update(
        fp8_server, tiny_model_dir, seed1_dir, http):
    await _check_matches_fp8_forward(http, fp8_server, tiny_model_dir)
    # A float checkpoint (the trainer's weights) is quantised on arrival, scales written too.
    res = await post(http, fp8_server, "/update_weights_from_disk", {"model_path": str(seed1_dir)})
    assert res["success"] is True, res
    await _check_matches_fp8_forward(http, fp8_server, seed1_dir)


def test_updates_to_an_fp8_model_take_float_or_fp8_weights_with_their_scales(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    replaced = quantize_linears(model)
    assert replaced and not any("lm_head" in n for n in replaced)
    state = model_state(model)
    name = f"{replaced[0]}.weight"
    assert state[name].dtype == FP8_DTYPE and f"{name}_scale_inv" in state
    new = torch.randn(state[name].shape) * 3
    assert check_metadata(state, [name], [torch.bfloat16], [tuple(new.shape)]) is None
    assert "dtype torch.int32" in check_metadata(state, [name], [torch.int32], [tuple(new.shape)])
    copy_into_model(state, {name: new})
    q, scale_inv = quantize_blockwise(new)
    assert torch.equal(state[name].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(state[f"{name}_scale_inv"], scale_inv)

    # A full checkpoint: float weights need no scales; FP8 weights do.
    full = {n: t.float() if t.dtype == FP8_DTYPE else t.clone() for n, t in state.items()
            if not n.endswith("_scale_inv")}
    assert check_full_checkpoint(state, full) is None
    fp8_full = {n: t.clone() for n, t in state.items() if not n.endswith("_scale_inv")}
    assert "_scale_inv" in check_full_checkpoint(state, fp8_full)


def test_the_fp8_tensor_core_path_is_chosen_only_on_a_capable_card():
    from arealite.server.fp8_linear import scaled_mm_supported

    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    assert not scaled_mm_supported(x, 256, 384)  # a CPU tensor: the de-quantising matmul
    if torch.cuda.is_available():
        assert not scaled_mm_supported(x.cuda(), 200, 384)  # not whole 128-blocks


@pytest.mark.parametrize("m,k,n", [(1, 8960, 1536), (7, 1536, 256), (3, 256, 128)])
def test_the_fp8_tensor_core_matmul_passes_torchs_layout_checks(m, k, n):
    """On meta tensors torch checks scaled_mm's scale shapes and strides as on a GPU (1.5B shapes)."""
    from arealite.server.fp8_linear import scaled_linear

    x = torch.empty(2, m, k, dtype=torch.bfloat16, device="meta")
    q = torch.empty(n, k, dtype=FP8_DTYPE, device="meta")
    out = scaled_linear(x, q, torch.empty(n // 128, k // 128, device="meta"), None)
    assert out.shape == (2, m, n) and out.dtype == torch.bfloat16


@pytest.mark.gpu
def test_the_fp8_tensor_core_matmul_matches_the_dequantised_one():
    from arealite.server.fp8_linear import Fp8Linear, scaled_mm_supported

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("block-scaled FP8 GEMMs need compute capability 9.x (H100/H200)")
    torch.manual_seed(0)
    layer = Fp8Linear(torch.nn.Linear(512, 384, bias=True)).cuda()
    layer.bias.data = layer.bias.data.bfloat16()
    x = torch.randn(3, 5, 512, device="cuda", dtype=torch.bfloat16)
    assert scaled_mm_supported(x, 512, 384)
    fast = layer(x)
    slow = torch.nn.functional.linear(x.float(), dequantize_blockwise(layer.weight, layer.weight_scale_inv).cuda(),
                                      layer.bias.float())
    assert fast.shape == slow.shape == (3, 5, 384) and fast.dtype == torch.bfloat16
    # Only the activations' e4m3 rounding (1x128 groups) and bf16 output separate the two.
    rel = (fast.float() - slow).norm() / slow.norm()
    assert rel < 0.05, float(rel)
    layer.weight_scale_inv.mul_(2)  # a wrong scale shows in the fast path too
    assert ((layer(x).float() - slow).norm() / slow.norm()) > 0.5
