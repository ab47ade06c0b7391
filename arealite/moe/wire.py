"""SGLang's ``meta_info.routed_experts``: the experts an MoE model routed each token to.

SGLang (``--enable-return-routed-experts``, request ``return_routed_experts: true``)
returns them as one base64 string of a little-endian int32 array in C order, of shape
``[prompt_tokens + completion_tokens - 1, num_layers, top_k]``: one row per token the
model ran forward (every prompt token and every generated token but the last, which no
forward has seen yet). The embedded server encodes with `encode_routed_experts`; the
inference client decodes with `decode_routed_experts` (docs/sglang.md).
"""

from __future__ import annotations

import base64

import numpy as np
import torch

__all__ = ["decode_routed_experts", "encode_routed_experts"]


def encode_routed_experts(chunks: list[torch.Tensor]) -> str:
    """Base64 of the concatenated ``[n, layers, k]`` chunks as little-endian int32, C order."""
    if not chunks:
        return ""
    rows = torch.cat(chunks).to(torch.int32).contiguous()
    data = rows.numpy().astype("<i4", copy=False).tobytes()
    return base64.b64encode(data).decode("ascii")


def decode_routed_experts(b64: object) -> torch.Tensor | None:
    """The ids of an `encode_routed_experts` string as a flat int32 tensor (None for None).

    The shape is not on the wire: the caller knows how many tokens the answer covers. Raises
    ValueError naming ``meta_info.routed_experts`` when ``b64`` is not such a string.
    """
    if b64 is None:
        return None
    if not isinstance(b64, str):
        raise ValueError(f"meta_info.routed_experts is a {type(b64).__name__}, expected a base64 string")
    try:
        data = base64.b64decode(b64, validate=True)
    except ValueError:
        raise ValueError("meta_info.routed_experts is not valid base64") from None
    if len(data) % 4:
        raise ValueError(f"meta_info.routed_experts holds {len(data)} bytes, not a whole number of int32")
    return torch.from_numpy(np.frombuffer(data, dtype="<i4").astype(np.int32))  # a copy: writable, native order
