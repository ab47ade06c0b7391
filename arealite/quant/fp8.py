"""Block-wise FP8 (e4m3) weights in the layout of DeepSeek-V3 / Qwen3 FP8 checkpoints.

A 2-D weight ``[out, in]`` is cut into ``block x block`` tiles (128x128; the tiles on the
right and bottom edges are partial). Each tile gets one float32 scale

    scale = amax(|tile|) / 448        (448 = the largest finite float8_e4m3fn)

and is stored as ``round_to_e4m3(tile / scale)``. The checkpoint stores the *inverse*
direction's multiplier under ``<module>.weight_scale_inv`` (shape
``[ceil(out/block), ceil(in/block)]``): de-quantising is ``q.float() * scale_inv``
broadcast over the tile. The name is historical (DeepSeek's loader calls the tensor
that multiplies the stored weight "scale_inv"); numerically it *is* amax / 448.
SGLang's block FP8 linear method reads exactly these two tensors (docs/sglang.md,
"FP8 weights").

Only the big matmul weights are quantised; embeddings, the LM head, norms, biases and
MoE routers stay in the trainer's dtype (see `stays_unquantised`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

FP8_DTYPE = torch.float8_e4m3fn
#: The largest finite float8_e4m3fn value.
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
BLOCK = 128
SCALE_SUFFIX = "_scale_inv"
#: Parameter-name fragments of the layers an FP8 server keeps in higher precision.
_UNQUANTISED_FRAGMENTS = ("embed_tokens", "lm_head", "norm", "mlp.gate.", "shared_expert_gate")


def _padded_tiles(w: torch.Tensor, block: int) -> tuple[torch.Tensor, int, int]:
    """`w` zero-padded to whole blocks and viewed as ``[rows_b, block, cols_b, block]``;
    padding with zeros never changes a tile's amax."""
    out, inp = w.shape
    rows_b, cols_b = -(-out // block), -(-inp // block)
    padded = torch.zeros(rows_b * block, cols_b * block, dtype=w.dtype, device=w.device)
    padded[:out, :inp] = w
    return padded.view(rows_b, block, cols_b, block), out, inp


def _check_2d(w: torch.Tensor, what: str) -> None:
    if w.dim() != 2:
        raise ValueError(f"{what} must be 2-D [out, in]; got shape {tuple(w.shape)} "
                         "(1-D tensors such as norms and biases stay unquantised)")


def quantize_blockwise(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 2-D weight to ``(q, scale_inv)``: ``q`` float8_e4m3fn of `w`'s shape,
    ``scale_inv`` float32 ``[ceil(out/block), ceil(in/block)]`` with ``w ~= q * scale_inv``
    tile by tile. An all-zero tile gets scale 1 (not 0: 0/0 would make NaNs)."""
    _check_2d(w, "the weight")
    tiles, out, inp = _padded_tiles(w.detach().float(), block)
    amax = tiles.abs().amax(dim=(1, 3))  # [rows_b, cols_b]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    # Dividing by amax/448 maps the tile's largest |value| to exactly 448; the clamp only
    # guards against a float rounding a hair over it.
    scaled = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = scaled.to(FP8_DTYPE).view(tiles.shape[0] * block, tiles.shape[2] * block)
    return q[:out, :inp].contiguous(), scale


def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight that ``(q, scale_inv)`` stands for, in `dtype`."""
    _check_2d(q, "the quantised weight")
    out, inp = q.shape
    want = (-(-out // block), -(-inp // block))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"scale_inv has shape {tuple(scale_inv.shape)}, but a {out}x{inp} "
                         f"weight in {block}x{block} blocks needs {want}")
    full = scale_inv.float().repeat_interleave(block, 0).repeat_interleave(block, 1)
    return (q.float() * full[:out, :inp]).to(dtype)


def stays_unquantised(name: str, tensor: torch.Tensor) -> bool:
    """Whether an FP8 server keeps this parameter in the trainer's dtype: every tensor
    that is not 2-D (norms, biases), the embeddings and LM head, norms, and MoE routers
    (``mlp.gate.weight``; the expert projections ``gate_proj``/``gate_up_proj`` are
    quantised)."""
    if tensor.dim() != 2 or not name.endswith(".weight"):
        return True
    return any(fragment in name for fragment in _UNQUANTISED_FRAGMENTS)


def scale_name(weight_name: str) -> str:
    """The name of the scale tensor that goes with `weight_name` (``x.weight`` ->
    ``x.weight_scale_inv``)."""
    return weight_name + SCALE_SUFFIX


def fp8_checkpoint_tensors(name: str, w: torch.Tensor,
                           block: int = BLOCK) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs a push of parameter `name` sends to an FP8 server:
    the FP8 weight and its ``weight_scale_inv`` for a quantised matmul weight, or the
    tensor unchanged for one that stays unquantised."""
    if stays_unquantised(name, w):
        yield name, w
        return
    q, scale_inv = quantize_blockwise(w, block)
    yield name, q
    yield scale_name(name), scale_inv
