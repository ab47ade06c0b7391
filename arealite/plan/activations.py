"""The activation bytes of a training forward and backward, from a traced run of one real layer.

One decoder layer of the model (built from its config as the engine builds it: the same
classes, LoRA adapters, the packed attention) runs forward and backward under
``FakeTensorMode`` on the micro-batch's real shape (``T`` tokens packed from the given
sequence lengths): nothing is computed and no memory is taken, while `LiveBytes`, a dispatch
mode, counts the bytes of the storages alive at each step. That gives, at the compute dtype:

- ``kept``: what the layer leaves alive after its forward (saved for backward, and its output);
  with activation checkpointing only the output (the input is the layer before's output);
- ``backward_peak``: the most the layer's backward adds on top of what was alive at its start
  (its recompute under checkpointing, the gradients of its intermediates and of its weights).

Scaling is by layers (every decoder layer of a text model has the same shapes) and by the
micro-batch's tokens (the trace runs at them). Under sequence parallelism the layer sees its
``T / sp`` tokens, and attention the whole row of ``heads / sp`` heads through the Ulysses
exchange (its buffers traced as well); under tensor parallelism the layer is traced with its
``heads / tp`` and ``width / tp`` (the split projections). A mixture-of-experts layer's
experts are traced with balanced routing (``T x top_k / E`` tokens each; under ep, each rank
receiving its share of the ``T x top_k`` rows), since the real routing is data-dependent.

`trace_tail` does the same for the final norm, the fused log-prob head
(`arealite.ops.fused_logprob`: two float32 ``[chunk, V]`` buffers in forward, the head's
float32 weight gradient in backward) and the loss.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from arealite.config.schema import LoraConfig

__all__ = ["LayerTrace", "LiveBytes", "TailTrace", "trace_layer", "trace_tail"]

#: The name the traced attention is registered under with transformers.
_TRACE_ATTENTION = "arealite_plan_trace"


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensor storages alive (created by ops while active, freed when
    their last reference dies); ``peak`` is the most seen, `reset_peak` restarts it."""

    def __init__(self) -> None:
        super().__init__()
        self._alive: dict[int, weakref.ref] = {}
        self.now = 0
        self.peak = 0

    def track(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage (once) until it is freed."""
        st = t.untyped_storage()
        key = id(st)
        if key in self._alive:
            return
        n = st.nbytes()
        self._alive[key] = weakref.ref(st, lambda _r, key=key, n=n: self._free(key, n))
        self.now += n
        self.peak = max(self.peak, self.now)

    def _free(self, key: int, n: int) -> None:
        if self._alive.pop(key, None) is not None:
            self.now -= n

    def reset_peak(self) -> int:
        self.peak = self.now
        return self.now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view or an in-place op returns an input's storage: counted where it was made, or
        # not at all when it was there before (a weight's transpose is the weight).
        inputs: set[int] = set()
        tree_map_only(torch.Tensor, lambda t: inputs.add(id(t.untyped_storage())), (args, kwargs))
        tree_map_only(torch.Tensor, lambda t: None if id(t.untyped_storage()) in inputs else self.track(t), out)
        return out


@dataclass(frozen=True)
class LayerTrace:
    """One decoder layer's activation bytes for one micro-batch on one rank."""

    tokens: int
    """Tokens the layer saw (``T / sp`` under sequence parallelism)."""
    kept: int
    """Alive after its forward, its output included (its input excluded)."""
    backward_peak: int
    """The most its backward adds over what was alive when it began."""
    unsplit_kept: int
    """``kept`` without checkpointing: what a checkpointed layer's recompute brings back."""


@dataclass(frozen=True)
class TailTrace:
    """The final norm, the output head and the loss on one rank's tokens."""

    forward_peak: int
    """The most alive above the layers' activations during the head's forward (the chunk)."""
    kept: int
    """Alive after the loss (saved for backward: the norm's, the head's ``lse``)."""
    backward_peak: int
    """The most the head's and norm's backward adds (the chunk again, gradients of the hidden
    states and the head's float32 weight gradient)."""


def _narrowed(hf_config, tp: int):
    """The text config of one tensor-parallel rank's layer: ``heads / tp``, ``width / tp``, one layer."""
    config = copy.deepcopy(hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    config.head_dim = head_dim
    if tp > 1:
        config.num_attention_heads //= tp
        kv = getattr(config, "num_key_value_heads", None) or hf_config.num_attention_heads
        config.num_key_value_heads = max(kv // tp, 1)
        if getattr(config, "intermediate_size", None):
            config.intermediate_size //= tp
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    return config


def _ulysses(inner, sp: int):
    """The trace's stand-in of `parallel.sequence.ulysses_attention` for ``sp`` ranks: the same
    buffers (each exchange a contiguous send and an equal receive buffer), no collective."""

    def to_heads(x):
        _, H, Tl, d = x.shape
        send = x[0].reshape(sp, H // sp, Tl, d).contiguous()
        recv = torch.empty_like(send) + send  # what the all-to-all fills (the graph kept)
        return recv.permute(1, 0, 2, 3).reshape(H // sp, sp * Tl, d)[None]

    def to_seq(x):
        _, Hl, T, d = x.shape
        send = x[0].reshape(Hl, sp, T // sp, d).transpose(0, 1).contiguous()
        return (torch.empty_like(send) + send).reshape(sp * Hl, T // sp, d)[None]

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        n_heads, kv = query.shape[1], key.shape[1]
        if kv % sp:
            reps = (sp if sp % kv == 0 else n_heads) // kv
            key, value = key.repeat_interleave(reps, dim=1), value.repeat_interleave(reps, dim=1)
        q, k, v = (to_heads(t) for t in (query, key, value))
        out, _ = inner(module, q, k, v, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        return to_seq(out.transpose(1, 2)).transpose(1, 2).contiguous(), None

    return attention


class _BalancedExperts(torch.nn.Module):
    """The trace's stand-in of a MoE block's experts (transformers' loop, or `ExpertShard` under
    ep): each local expert gets an equal share of the ``T x top_k`` (token, expert) pairs."""

    def __init__(self, experts: torch.nn.Module, ep: int):
        super().__init__()
        self.ep = ep
        n = experts.gate_up_proj.shape[0]
        self.n_local = n // ep
        self.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach()[: self.n_local])
        self.down_proj = torch.nn.Parameter(experts.down_proj.detach()[: self.n_local])
        self.act_fn = experts.act_fn

    def _rows(self, total: int, e: int, device) -> torch.Tensor:
        share = total // self.n_local + (e < total % self.n_local)
        return torch.zeros(share, dtype=torch.long, device=device)

    def forward(self, hidden, top_k_index, top_k_weights):
        k = top_k_index.shape[1]
        pairs = hidden.shape[0] * k
        if self.ep == 1:  # transformers' loop, in place into one output
            out = torch.zeros_like(hidden)
            for e in range(self.n_local):
                rows = self._rows(pairs, e, hidden.device)
                y = self._expert(hidden[rows], e) * top_k_weights.reshape(-1)[rows, None]
                out.index_add_(0, rows, y.to(out.dtype))
            return out
        order = torch.zeros(pairs, dtype=torch.long, device=hidden.device)
        x = torch.empty_like(hidden[order]) + hidden[order]  # sent and received (balanced)
        out = x.new_zeros(x.shape) + 0.0 * x.sum()
        for e in range(self.n_local):
            rows = self._rows(pairs, e, x.device)
            out = out.index_copy(0, rows, self._expert(x[rows], e))
        y = torch.empty_like(out) + out
        weighted = y * top_k_weights.reshape(-1)[order, None].to(y.dtype)
        return torch.zeros_like(hidden).index_add(0, order, weighted.to(hidden.dtype))

    def _expert(self, x, e):
        gate, up = torch.nn.functional.linear(x, self.gate_up_proj[e].to(x.dtype)).chunk(2, dim=-1)
        return torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e].to(x.dtype))


def _cu_seqlens(seq_lens: list[int], sp: int) -> tuple[torch.Tensor, int, int]:
    """The packed row's boundaries (padded to a multiple of ``sp`` as the engine pads it), its
    longest sequence and its padded length."""
    T = sum(seq_lens)
    padded = -(-T // sp) * sp
    bounds = [0]
    for n in seq_lens:
        bounds.append(bounds[-1] + n)
    if padded > T:
        bounds.append(padded)
    return torch.tensor(bounds, dtype=torch.int32), max(max(seq_lens), padded - T), padded


def _attention_fn(sp: int):
    from arealite.train_engine.attention import sdpa_loop_attention

    return sdpa_loop_attention if sp == 1 else _ulysses(sdpa_loop_attention, sp)


def trace_layer(hf_config, seq_lens: list[int], dtype: torch.dtype, *, checkpointing: bool = False,
                sp: int = 1, tp: int = 1, ep: int = 1, lora: LoraConfig | None = None,
                value_model: bool = False) -> LayerTrace:
    """Trace one decoder layer's forward and backward on a packed micro-batch of sequences of
    ``seq_lens`` tokens (this rank's share of it under ``sp``; its split under ``tp`` and ``ep``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AttentionInterface

    from arealite.plan.model_shapes import meta_model
    from arealite.train_engine.fsdp_model import decoder_layers

    AttentionInterface.register(_TRACE_ATTENTION, _attention_fn(sp))
    cu, max_len, padded = _cu_seqlens(seq_lens, sp)
    local = padded // sp
    config = _narrowed(hf_config, tp)
    model = meta_model(config, value_model=value_model, lora=lora, attn_implementation=_TRACE_ATTENTION, dtype=dtype)
    layer = decoder_layers(model)[0]
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    rotary = inner.model.rotary_emb
    with FakeTensorMode(allow_non_fake_inputs=True):
        layer.to_empty(device="cpu")
        rotary.to_empty(device="cpu")
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and hasattr(getattr(mlp, "experts", None), "gate_up_proj"):
            mlp.experts = _BalancedExperts(mlp.experts, ep)
        h = torch.empty(1, local, config.hidden_size, dtype=dtype, requires_grad=True)
        pos = torch.zeros(1, local, dtype=torch.long)
        pe = rotary(h, pos)
        grad_out = torch.empty(1, local, config.hidden_size, dtype=dtype)
        kwargs = dict(attention_mask=None, position_embeddings=pe, position_ids=pos, cu_seq_lens_q=cu,
                      max_length_q=max_len)
        unsplit = _run_layer(layer, h, grad_out, kwargs, checkpointing=False)
        traced = unsplit if not checkpointing else _run_layer(layer, h, grad_out, kwargs, checkpointing=True)
    return LayerTrace(tokens=local, kept=traced[0], backward_peak=traced[1], unsplit_kept=unsplit[0])


def _run_layer(layer, h, grad_out, kwargs, checkpointing: bool) -> tuple[int, int]:
    """``(kept, backward peak over start)`` of one forward and backward of ``layer``."""
    from torch.utils.checkpoint import checkpoint

    live = LiveBytes()
    with live:
        if checkpointing:
            out = checkpoint(lambda x: layer(x, **kwargs), h, use_reentrant=False)
        else:
            out = layer(h, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        kept = live.now
        start = live.reset_peak()
        out.backward(grad_out)
        peak = live.peak - start
    return kept, peak


def trace_tail(hf_config, tokens: int, dtype: torch.dtype, *, entropy: bool = False,
               value_model: bool = False, chunk_size: int | None = None) -> TailTrace:
    """Trace the final norm, the output head (fused log-probs, or a value model's ``[T, 1]``) and
    a token-mean loss over ``tokens`` tokens, forward and backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from arealite.ops.fused_logprob import fused_logprobs_entropy

    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    H, V = text.hidden_size, text.vocab_size
    with FakeTensorMode(allow_non_fake_inputs=True):
        norm_weight = torch.empty(H, dtype=dtype, requires_grad=True)
        head = torch.empty(1 if value_model else V, H, dtype=dtype, requires_grad=True)
        h = torch.empty(1, tokens, H, dtype=dtype, requires_grad=True)
        labels = torch.zeros(tokens, dtype=torch.long)
        live = LiveBytes()
        with live:
            x = h.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            normed = norm_weight * x.to(dtype)
            if value_model:
                values = torch.nn.functional.linear(normed[0], head).float()
                loss = values.square().mean()
            else:
                logp, ent = fused_logprobs_entropy(normed[0], head, labels, chunk_size=chunk_size,
                                                   with_entropy=entropy)
                loss = -logp.mean() - (ent.mean() if entropy else 0.0)
            forward_peak, kept = live.peak, live.now
            start = live.reset_peak()
            loss.backward()
            backward_peak = live.peak - start
    return TailTrace(forward_peak=forward_peak, kept=kept, backward_peak=backward_peak)
