"""Attention over packed micro-batches: the implementations ``actor.attn_impl`` chooses from.

A packed micro-batch is one row of ``T`` tokens holding several sequences; its boundaries
``cu_seqlens [n + 1]`` reach the model as the ``cu_seq_lens_q`` keyword, which transformers
passes down to the attention function of every layer. Each implementation here runs causal
attention within each sequence only and is registered with transformers'
``AttentionInterface``; the engine loads the model with the one ``resolve_attn_impl`` picks:

- ``varlen``: ``torch.nn.attention.varlen.varlen_attn``, FlashAttention's variable-length
  kernel: one kernel per layer for the whole row, no padding, no cross-sequence blocks.
  CUDA only, bfloat16/float16 compute. The max sequence length it needs (a host int) comes
  from the ``max_length_q`` keyword when the caller passes it; otherwise it is read from the
  boundaries once per micro-batch (the first layer) and reused by the others.
- ``flex``: flex attention with a document-causal block mask, built once per micro-batch
  (cached on the boundaries tensor; every layer and the recompute of gradient checkpointing
  reuse it). On CUDA it runs the compiled, block-sparse kernel. On CPU torch 2.13's
  ``flex_attention`` refuses inputs that require grad, so it runs the flex-attention operator
  underneath, whose CPU kernel is the unfused reference (the ``[H, T, T]`` scores are
  materialised and the mask evaluated densely): correct, with gradients, but slower than
  ``sdpa_loop`` (see docs/training.md).
- ``sdpa_loop``: one SDPA call per run of adjacent equal-length sequences (the boundaries
  are read back to the host once per micro-batch, and a long-tailed micro-batch is many
  small kernels). Runs anywhere; the fallback.

``auto``: ``varlen`` on CUDA with bfloat16/float16 compute and FlashAttention available,
else ``sdpa_loop`` (on CPU it is faster than ``flex``: measured by
``benchmarks/bench_train.py --attn``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from arealite.train_engine.parallel.sequence import ulysses_attention

__all__ = [
    "ATTN_IMPLS", "ATTENTION_NAMES", "register_attention", "resolve_attn_impl",
    "sdpa_loop_attention", "varlen_attention", "flex_attention", "document_causal_block_mask",
]

#: The values of ``actor.attn_impl``.
ATTN_IMPLS = ("auto", "varlen", "flex", "sdpa_loop")

#: Name under which each implementation is registered with transformers (no "flash" or
#: "flex_attention" in them: transformers gives those substrings special handling).
ATTENTION_NAMES = {
    "sdpa_loop": "arealite_varlen_sdpa",
    "varlen": "arealite_varlen_fa",
    "flex": "arealite_flex_doc",
}

#: What ``auto`` picks where ``varlen`` cannot run (CPU, fp32 compute, no FlashAttention):
#: on CPU ``flex``'s unfused kernel is slower than the SDPA loop (docs/training.md).
AUTO_FALLBACK = "sdpa_loop"


def _check_no_mask(name: str, attention_mask) -> None:
    if attention_mask is not None:
        raise ValueError(f"{name} takes sequence boundaries (cu_seq_lens_q), not an attention mask")


_NONE = object()  # the key of a row without boundaries (one causal sequence)


def _sliding_window(kwargs: dict) -> int | None:
    """The layer's sliding window (``sliding_window``, passed by the model for the layers that
    have one: Mistral's every layer, Qwen2's and Qwen3's ``sliding_attention`` layers): a token
    sees itself and the ``window - 1`` tokens before it, as in transformers' masks and SGLang.
    None: full causal attention."""
    window = kwargs.get("sliding_window")
    return int(window) if window else None


def _band(n: int, window: int, device: torch.device) -> torch.Tensor:
    """The ``[n, n]`` mask of causal attention within a sliding window (True: attends)."""
    i = torch.arange(n, device=device)
    gap = i[:, None] - i[None, :]
    return (gap >= 0) & (gap < window)


class _PerMicroBatch:
    """A one-entry cache keyed on the boundaries tensor of the micro-batch being run.

    Every layer of one forward (and the recompute of gradient checkpointing) gets the same
    ``cu_seq_lens_q`` tensor object; a new micro-batch brings a new one. The key holds a weak
    reference, so a freed tensor never matches a new one at the same address.
    """

    def __init__(self, build: Callable[[torch.Tensor | None, int, torch.device], object]):
        self._build = build
        self._ref: Callable[[], object] = lambda: None
        self._key: tuple[int, torch.device] | None = None
        self._value: object = None

    def get(self, cu: torch.Tensor | None, T: int, device: torch.device) -> object:
        """The value for boundaries ``cu`` of a ``T``-token row on ``device``, built on a miss."""
        if self._key != (T, device) or self._ref() is not (_NONE if cu is None else cu):
            self._value = self._build(cu, T, device)
            self._ref = (lambda: _NONE) if cu is None else weakref.ref(cu)
            self._key = (T, device)
        return self._value


# ---------------------------------------------------------------------------- sdpa_loop


def _host_bounds(cu: torch.Tensor | None, T: int, device: torch.device) -> list[int]:
    """The boundaries as host ints (one read back per micro-batch)."""
    return [0, T] if cu is None else [int(x) for x in cu.tolist()]


_loop_bounds = _PerMicroBatch(_host_bounds)


def sdpa_loop_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention within each packed sequence, one SDPA call per run of equal lengths.

    ``query/key/value`` are ``[1, heads, T, head_dim]`` of a packed row; the sequence
    boundaries come from the ``cu_seq_lens_q`` keyword the engine passes to the model. No
    token sees another sequence and no compute is spent on cross-sequence blocks. Without
    boundaries the whole row is one causal sequence. The boundaries are read back to the
    host once per micro-batch (the first layer; a device sync on a GPU) and reused by the
    other layers. Returns ``([1, T, heads, head_dim], None)``.
    """
    _check_no_mask(ATTENTION_NAMES["sdpa_loop"], attention_mask)
    T = query.shape[2]
    bounds = _loop_bounds.get(kwargs.get("cu_seq_lens_q"), T, query.device)
    if bounds[-1] != T:
        raise ValueError(f"cu_seq_lens_q ends at {bounds[-1]} but the packed row has {T} tokens")
    gqa = key.shape[1] != query.shape[1]
    p = dropout if module.training else 0.0
    window = _sliding_window(kwargs)
    outs = []
    # Adjacent sequences of equal length (first-fit-decreasing packs them next to
    # each other) run as one batched SDPA call instead of one call each.
    i = 0
    while i < len(bounds) - 1:
        a, n = bounds[i], bounds[i + 1] - bounds[i]
        k = 1
        while i + k < len(bounds) - 1 and bounds[i + k + 1] - bounds[i + k] == n:
            k += 1
        i += k
        if n == 0:
            continue
        b = a + k * n

        def rows(t, a=a, b=b, k=k, n=n):  # [1, h, k*n, d] -> [k, h, n, d]
            return t[0, :, a:b].unflatten(1, (k, n)).transpose(0, 1)

        banded = window is not None and n > window
        o = torch.nn.functional.scaled_dot_product_attention(
            rows(query), rows(key), rows(value), attn_mask=_band(n, window, query.device) if banded else None,
            is_causal=not banded, scale=scaling, dropout_p=p, enable_gqa=gqa
        )
        outs.append(o.transpose(0, 1).flatten(1, 2)[None])  # back to [1, h, k*n, d]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


# ---------------------------------------------------------------------------- varlen


def _max_length(cu: torch.Tensor, T: int, device: torch.device) -> int:
    """The longest sequence of boundaries ``cu`` (one read back to the host)."""
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


_varlen_bounds = _PerMicroBatch(_max_length)


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention within each packed sequence with FlashAttention's varlen kernel (CUDA).

    One kernel for the whole ``[1, heads, T, head_dim]`` row: ``cu_seq_lens_q`` (int32, on the
    device) gives the boundaries, ``max_length_q`` (a host int) the longest sequence; without
    ``max_length_q`` it is read from the boundaries once per micro-batch and cached. Returns
    ``([1, T, heads, head_dim], None)``.
    """
    from torch.nn.attention.varlen import varlen_attn

    _check_no_mask(ATTENTION_NAMES["varlen"], attention_mask)
    if dropout and module.training:
        raise ValueError("actor.attn_impl=varlen runs without dropout; the engine turns dropout off")
    T = query.shape[2]
    cu, max_len = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is None:
        cu, max_len = torch.tensor([0, T], dtype=torch.int32, device=query.device), T
    elif max_len is None:
        max_len = _varlen_bounds.get(cu, T, query.device)
    cu = cu.to(device=query.device, dtype=torch.int32)
    # [1, h, T, d] -> [T, h, d]: a view of the projection's [T, h, d] output, last dim contiguous.
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    gqa = {}
    if key.shape[1] != query.shape[1]:
        if _varlen_takes_gqa():
            gqa = {"enable_gqa": True}
        else:  # torch before 2.13: each KV head repeated for its group of query heads
            group = query.shape[1] // key.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    window = _sliding_window(kwargs)
    out = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scaling,
                      window_size=(-1 if window is None else window - 1, 0), **gqa)
    return out[None], None


@functools.cache
def _varlen_takes_gqa() -> bool:
    """Whether this torch's ``varlen_attn`` shares KV heads itself (``enable_gqa``, torch 2.13)."""
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


# ---------------------------------------------------------------------------- flex


def document_causal_block_mask(cu: torch.Tensor | None, T: int, device: torch.device, window: int | None = None):
    """The flex-attention ``BlockMask`` of a packed row: token ``q`` sees ``kv`` iff both are in
    the same sequence and ``kv <= q`` (and ``q - kv < window`` with a sliding window). Built on
    ``device`` without reading anything back."""
    from torch.nn.attention.flex_attention import create_block_mask

    pos = torch.arange(T, device=device)
    if cu is None:
        doc = torch.zeros(T, dtype=torch.int64, device=device)
    else:
        # Sequence index of each token: how many boundaries after the first are <= its position.
        doc = torch.searchsorted(cu[1:].to(device=device, dtype=torch.int64), pos, right=True)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def window_mask_mod(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx, kv_idx) & (q_idx - kv_idx < window)

    return create_block_mask(mask_mod if window is None else window_mask_mod, None, None, T, T, device=device)


#: The block mask of the micro-batch, per sliding window (None: full causal attention); a model
#: whose layers mix windowed and full attention keeps one of each.
_flex_masks: dict[int | None, _PerMicroBatch] = {}


def _flex_mask(cu: torch.Tensor | None, T: int, device: torch.device, window: int | None):
    if window not in _flex_masks:
        _flex_masks[window] = _PerMicroBatch(functools.partial(document_causal_block_mask, window=window))
    return _flex_masks[window].get(cu, T, device)
_compiled_flex: list[Callable] = []


def _flex_cuda(q, k, v, block_mask, scale, gqa):
    if not _compiled_flex:
        from torch.nn.attention.flex_attention import flex_attention as flex

        _compiled_flex.append(torch.compile(flex))
    return _compiled_flex[0](q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)


def _flex_reference(q, k, v, block_mask, scale):
    """The flex-attention operator's own (unfused) kernel, with its autograd: what runs on CPU,
    where the public ``flex_attention`` refuses inputs that require grad."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_op  # private-ok: see docstring
    from torch.nn.attention.flex_attention import _apply_kernel_options  # private-ok: same options as the API

    if scale is None:
        scale = q.shape[-1] ** -0.5
    options = _apply_kernel_options(q, k, v, False, None)
    out, _lse, _max = flex_op(q, k, v, _identity_score, block_mask.as_tuple(), scale, options)
    return out


def _identity_score(score, b, h, q_idx, kv_idx):
    return score


def flex_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention within each packed sequence with flex attention and a document-causal
    block mask (built once per micro-batch). GQA through ``enable_gqa`` (the reference kernel
    repeats the KV heads itself). Returns ``([1, T, heads, head_dim], None)``."""
    _check_no_mask(ATTENTION_NAMES["flex"], attention_mask)
    if dropout and module.training:
        raise ValueError("actor.attn_impl=flex runs without dropout; the engine turns dropout off")
    T = query.shape[2]
    block_mask = _flex_mask(kwargs.get("cu_seq_lens_q"), T, query.device, _sliding_window(kwargs))
    if query.device.type == "cuda":
        out = _flex_cuda(query, key, value, block_mask, scaling, key.shape[1] != query.shape[1])
    else:
        out = _flex_reference(query, key, value, block_mask, scaling)
    return out.transpose(1, 2).contiguous(), None


# ---------------------------------------------------------------------------- choosing

_FUNCTIONS = {"sdpa_loop": sdpa_loop_attention, "varlen": varlen_attention, "flex": flex_attention}


def register_attention(impl: str = "sdpa_loop", sp_group: dist.ProcessGroup | None = None) -> str:
    """Register implementation ``impl`` (not ``auto``) with transformers (idempotent); returns the
    name to load a model with (``attn_implementation=``). With ``sp_group`` (a sequence-parallel
    group of more than one rank) ``impl`` runs inside Ulysses' all-to-alls over that group
    (`arealite.train_engine.parallel.sequence`)."""
    from transformers import AttentionInterface

    if impl not in _FUNCTIONS:
        raise ValueError(f"attention implementation {impl!r} is not one of {sorted(_FUNCTIONS)}")
    if sp_group is None or dist.get_world_size(sp_group) == 1:
        AttentionInterface.register(ATTENTION_NAMES[impl], _FUNCTIONS[impl])
        return ATTENTION_NAMES[impl]
    name = f"{ATTENTION_NAMES[impl]}_ulysses"
    AttentionInterface.register(name, ulysses_attention(_FUNCTIONS[impl], sp_group))
    return name


def _varlen_problem(device_type: str, dtype: torch.dtype, section: str) -> str | None:
    """Why ``varlen`` cannot run here (None: it can)."""
    if device_type != "cuda":
        return f"it is a CUDA kernel (FlashAttention) and this engine runs on {device_type}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"FlashAttention computes in bfloat16/float16 and the compute dtype is {dtype} ({section}.dtype)"
    try:
        importlib.import_module("torch.nn.attention.varlen")
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if torch.cuda.is_available():
        if not torch.backends.cuda.is_flash_attention_available():
            return "this torch build has no FlashAttention kernels"
        if torch.cuda.get_device_capability() < (8, 0):
            return f"FlashAttention needs compute capability >= 8.0 ({torch.cuda.get_device_name()} has less)"
    return None


def resolve_attn_impl(choice: str, device_type: str, dtype: torch.dtype, field: str = "actor.attn_impl") -> str:
    """The implementation ``choice`` means on ``device_type`` with compute ``dtype``.

    ``auto``: ``varlen`` where it can run, else ``AUTO_FALLBACK``. An explicit choice that cannot
    run here raises ``ValueError`` naming ``field``.
    """
    section = field.rpartition(".")[0] or "actor"
    if choice not in ATTN_IMPLS:
        raise ValueError(f"{field}={choice!r} is not one of {', '.join(ATTN_IMPLS)}")
    if choice == "auto":
        return "varlen" if _varlen_problem(device_type, dtype, section) is None else AUTO_FALLBACK
    if choice == "varlen" and (why := _varlen_problem(device_type, dtype, section)) is not None:
        raise ValueError(f"{field}=varlen cannot run here: {why}; use {field}=auto, flex or sdpa_loop")
    if choice == "flex":
        try:
            importlib.import_module("torch.nn.attention.flex_attention")
        except ImportError as e:
            raise ValueError(f"{field}=flex needs torch.nn.attention.flex_attention ({e}); use sdpa_loop") from e
    return choice
