"""SGLang's ``meta_info.routed_experts``: the experts an MoE model routed each token to.

SGLang (``--enable-return-routed-experts``, request ``return_routed_experts: true``)
returns them as one base64 string of a little-endian int32 array in C order, of shape
``[prompt_tokens + completion_tokens - 1, num_layers, top_k]``: one row per token the
model ran forward (every prompt token and every generated token but the last, which no
forward has seen yet). The client's decoder is ``arealite.inference_client.sglang_wire``.
"""

from __future__ import annotations

import base64

import torch


def encode_routed_experts(chunks: list[torch.Tensor]) -> str:
    """Base64 of the concatenated ``[n, layers, k]`` chunks as little-endian int32, C order."""
    if not chunks:
        return ""
    rows = torch.cat(chunks).to(torch.int32).contiguous()
    data = rows.numpy().astype("<i4", copy=False).tobytes()
    return base64.b64encode(data).decode("ascii")
