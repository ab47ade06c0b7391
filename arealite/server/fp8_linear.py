"""The embedded server's FP8 linear layers (``--quantization fp8``), on any device.

Each quantised ``nn.Linear`` becomes an `Fp8Linear` that stores its weight as block-wise
float8_e4m3fn with a float32 ``weight_scale_inv`` (`arealite.quant.fp8`, the layout SGLang
serves) and de-quantises it block by block in every matmul: the arithmetic is that of an
ordinary linear layer whose weight is the FP8-rounded one, so a trainer forward with the
same rounded weights reproduces the server's log-probs exactly. On a GPU with FP8 tensor
cores (compute capability 9.x: H100/H200) a layer whose sizes are whole 128-blocks multiplies
in FP8 instead, as SGLang's block FP8 method does: the activations are quantised per token
in groups of 128 (``1x128`` scales) and ``torch.nn.functional.scaled_mm`` multiplies them with the
``128x128``-scaled weight (`scaled_mm_supported`); the result then differs from the
de-quantised matmul by the activations' rounding (within the bf16 probe tolerance).

Weight updates address the same names as SGLang: ``x.weight`` and ``x.weight_scale_inv``.
An FP8 ``x.weight`` is stored as sent (its scale comes beside it, as SGLang expects); a
floating-point one (the trainer's bf16/fp32) is quantised here and its scale written too,
which SGLang does not do (docs/sglang.md, "FP8 weights").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from arealite.quant.fp8 import BLOCK, FP8_DTYPE, FP8_MAX, dequantize_blockwise, quantize_blockwise, scale_name, stays_unquantised


#: Rows (tokens) the FP8 GEMM's activations are padded to a multiple of: the 1x128 scales are
#: stored outer-dim-major, and cuBLAS wants their leading dimension in whole 16 bytes. On an H200
#: (torch 2.11, CUDA 13) it answered CUBLAS_STATUS_NOT_SUPPORTED for 1, 2, 3, 15 and 17 rows and
#: ran 4, 8, 12, 16, 24, 32, 48 and 64 (28 Nov).
ROWS_MULTIPLE = 4


class Fp8Linear(torch.nn.Module):
    """``y = x @ dequant(weight, weight_scale_inv).T + bias``; weight and scale are buffers,
    so the model's state dict names them as an FP8 checkpoint does."""

    weight: torch.Tensor
    weight_scale_inv: torch.Tensor

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale_inv = quantize_blockwise(linear.weight.detach())
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale_inv", scale_inv)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if scaled_mm_supported(x, self.in_features, self.out_features):
            return scaled_linear(x, self.weight, self.weight_scale_inv, self.bias)
        w = dequantize_blockwise(self.weight, self.weight_scale_inv, dtype=x.dtype)
        return F.linear(x, w, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 block-wise"


def scaled_mm_supported(x: torch.Tensor, in_features: int, out_features: int) -> bool:
    """Whether this layer multiplies on FP8 tensor cores (`F.scaled_mm`, block scales): a CUDA
    card of compute capability 9.x (cuBLAS's block-scaled FP8 GEMMs), 16-bit activations, and
    sizes in whole 128-blocks (SGLang's `validate_block_quant_shapes` asks the same)."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and hasattr(F, "scaled_mm")
            and in_features % BLOCK == 0 and out_features % BLOCK == 0
            and torch.cuda.get_device_capability(x.device)[0] == 9)


def scaled_linear(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ dequant(q, scale_inv).T + bias`` on FP8 tensor cores: `x` quantised per token in
    1x128 groups, `q` with its 128x128 scales (DeepSeek-V3's recipe)."""
    from torch.nn.functional import ScalingType

    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    rows = x2.shape[0]
    if rows % ROWS_MULTIPLE:  # zero rows: their scales clamp to a tiny value, their outputs are cut
        x2 = F.pad(x2, (0, 0, 0, -rows % ROWS_MULTIPLE))
    groups = x2.float().view(x2.shape[0], -1, BLOCK)
    x_scale = (groups.abs().amax(-1) / FP8_MAX).clamp(min=1e-12)  # [M, K/128]
    xq = (groups / x_scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view_as(x2)
    # cuBLAS's layouts: the 1x128 scales outer-dim-major; the weight [N, K] row-major, so q.t() is
    # the column-major [K, N] operand, and its scales [K/128 rounded up to 4, N/128] K-major (the
    # padding rows stand for no K-block: any value).
    m, k_blocks = x_scale.shape
    a_scale = torch.empty_strided((m, k_blocks), (1, m), dtype=torch.float32, device=x.device).copy_(x_scale)
    w_scale = F.pad(scale_inv.float(), (0, -k_blocks % 4), value=1.0)
    out = F.scaled_mm(xq, q.t(), a_scale, ScalingType.BlockWise1x128, w_scale.t(),
                      ScalingType.BlockWise128x128, output_dtype=x.dtype)
    out = out[:rows]
    if bias is not None:
        out = out + bias
    return out.view(*shape[:-1], q.shape[0])


def quantize_linears(model: torch.nn.Module) -> list[str]:
    """Replace every ``nn.Linear`` an FP8 server quantises (not the LM head, routers, ...:
    `stays_unquantised`) by an `Fp8Linear`; return the replaced modules' names."""
    targets = [(name, mod) for name, mod in model.named_modules()
               if isinstance(mod, torch.nn.Linear) and not stays_unquantised(f"{name}.weight", mod.weight)]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, Fp8Linear(mod))
    return [name for name, _ in targets]


def is_quantised_slot(target: torch.Tensor) -> bool:
    return target.dtype == FP8_DTYPE


def arrives_quantised(target: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a tensor of `dtype` sent for `target` is taken by quantising it here."""
    return is_quantised_slot(target) and dtype != FP8_DTYPE and dtype.is_floating_point


def sglang_fp8_problem(state: dict[str, torch.Tensor], named_dtypes: list[tuple[str, torch.dtype]]) -> str | None:
    """Why SGLang would load this update wrongly into an FP8 model, or None: it copies a
    floating tensor sent for an FP8 ``weight`` into it by a plain cast, without its scale
    (docs/sglang.md, "FP8 weights"). The strict stand-in refuses such an update."""
    for name, dtype in named_dtypes:
        if name in state and arrives_quantised(state[name], dtype):
            return (f"tensor {name!r}: a {str(dtype).removeprefix('torch.')} tensor sent into an FP8 weight; "
                    f"SGLang would cast it without its {scale_name(name).rpartition('.')[2]} (wrong weights): "
                    "push the float8_e4m3fn weight and its scale (server.quantization=fp8 makes the trainer do so)")
    return None


@torch.no_grad()
def store(state: dict[str, torch.Tensor], name: str, tensor: torch.Tensor) -> None:
    """Write `tensor` into the model's tensor `name`: cast to its dtype, or, for a floating
    tensor sent to an FP8 weight, quantised with its ``weight_scale_inv`` written beside it."""
    target = state[name]
    if arrives_quantised(target, tensor.dtype):
        q, scale_inv = quantize_blockwise(tensor.to(target.device))
        target.copy_(q)
        state[scale_name(name)].copy_(scale_inv)
    else:
        target.copy_(tensor.to(device=target.device, dtype=target.dtype))
