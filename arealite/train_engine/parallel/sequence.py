"""Ulysses sequence parallelism: one packed micro-batch computed by ``sp`` ranks together.

The ranks of a sequence-parallel group hold the same packed micro-batch (``T`` tokens, padded to
a multiple of ``sp``) and each runs the model on its own ``T / sp`` consecutive tokens. Every
operation of a decoder block but attention works token by token, so it runs on the local tokens
unchanged (rotary embeddings read the local ``position_ids``). Attention needs every token of a
sequence: around it an all-to-all trades the sequence split for a head split, so that each rank
holds all ``T`` tokens of ``heads / sp`` heads and runs the packed attention implementation on
the whole row (with the whole row's boundaries), then a second all-to-all trades back.

KV heads fewer than the ranks (or not dividing among them) are repeated before the exchange, so
that each rank holds the KV heads its query heads read; the gradient sums over the copies.

The loss needs the log-probs of the whole micro-batch: `SequenceParallelHead` computes them on
the local tokens and gathers them from the group. Every rank then computes the same loss, and
the gather's backward hands each rank the gradient of its own tokens, so each rank's parameter
gradients are its part of the whole; summed over the group (FSDP2 reduces over all ranks) they
are the gradient of the micro-batch's loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["SequenceParallel", "SequenceParallelHead", "gather_tokens", "token_share", "ulysses_attention"]


class _Exchange(torch.autograd.Function):
    """The all-to-all between the two layouts of attention's inputs: ``to_heads`` takes
    ``[1, H, T/sp, d]`` (all heads, local tokens) to ``[1, H/sp, T, d]`` (local heads, all
    tokens), else the other way; the backward exchanges the gradient back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad, ctx.group), None, None


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    sp = dist.get_world_size(group)
    _, H, Tl, d = x.shape
    # Block j (heads [j*H/sp, (j+1)*H/sp)) goes to rank j; block i received is rank i's tokens.
    send = x[0].reshape(sp, H // sp, Tl, d).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3).reshape(H // sp, sp * Tl, d)[None]


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    sp = dist.get_world_size(group)
    _, Hl, T, d = x.shape
    # Block i (tokens of rank i) goes to rank i; block j received is rank j's heads.
    send = x[0].reshape(Hl, sp, T // sp, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.reshape(sp * Hl, T // sp, d)[None]


class _GatherTokens(torch.autograd.Function):
    """Each rank's ``[Tl, ...]`` concatenated in rank order; the backward keeps the local part of
    the gradient (every rank computes the same loss from the gathered tensor)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        sp, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.rank, ctx.n = rank, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(sp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None


def gather_tokens(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Each rank's ``[Tl, ...]`` concatenated in rank order (a collective); the backward keeps
    this rank's part of the gradient."""
    return _GatherTokens.apply(x, group)


def token_share(x: torch.Tensor, size: int, rank: int, fill: float = -1) -> torch.Tensor:
    """Rank ``rank``'s consecutive share of a per-token tensor ``[T, ...]`` split over ``size``
    ranks, the tensor padded with ``fill`` to a multiple of ``size`` first."""
    per_rank = -(-x.shape[0] // size)
    n_pad = per_rank * size - x.shape[0]
    if n_pad:
        x = torch.cat([x, x.new_full((n_pad, *x.shape[1:]), fill)])
    return x[rank * per_rank:(rank + 1) * per_rank]


def _repeat_kv(key: torch.Tensor, n_heads: int, sp: int) -> torch.Tensor:
    """``key [1, KV, T, d]`` with each head repeated so that the KV heads split evenly over ``sp``
    ranks next to the query heads that read them (to ``sp`` heads, or to one per query head)."""
    kv = key.shape[1]
    if kv % sp == 0:
        return key
    target = sp if sp % kv == 0 else n_heads
    return key.repeat_interleave(target // kv, dim=1)


AttentionFn = Callable[..., tuple[torch.Tensor, None]]


def ulysses_attention(inner: AttentionFn, group: dist.ProcessGroup) -> AttentionFn:
    """An attention function (transformers' interface) that runs ``inner`` on all tokens of the
    local heads: the all-to-alls of the module's docstring around it. ``inner`` gets the whole
    row's boundaries (``cu_seq_lens_q``), which the engine passes to every rank."""
    sp = dist.get_world_size(group)

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        n_heads = query.shape[1]
        if n_heads % sp:
            raise ValueError(f"{n_heads} attention heads do not split over sp_size={sp} ranks")
        key, value = _repeat_kv(key, n_heads, sp), _repeat_kv(value, n_heads, sp)
        q, k, v = (_Exchange.apply(t, group, True) for t in (query, key, value))
        out, _ = inner(module, q, k, v, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        # inner returns [1, T, H/sp, d]; back to [1, T/sp, H, d].
        local = _Exchange.apply(out.transpose(1, 2), group, False)
        return local.transpose(1, 2).contiguous(), None

    return attention


class SequenceParallelHead:
    """The `HeadOutput` of a whole micro-batch from the local part of it (``local``, a `HeadOutput`
    over this rank's ``T_pad / sp`` tokens): every method returns the whole ``[T, ...]``, gathered
    from the group, with the padding dropped."""

    def __init__(self, local, group: dist.ProcessGroup, n_tokens: int):
        self.local, self.group, self.n_tokens = local, group, n_tokens
        self._sp, self._rank = dist.get_world_size(group), dist.get_rank(group)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        return gather_tokens(x, self.group)[: self.n_tokens]

    def _local_labels(self, labels: torch.Tensor) -> torch.Tensor:
        n_pad = self._pad_to() - labels.shape[0]
        if n_pad:
            labels = torch.cat([labels, labels.new_zeros(n_pad)])
        per_rank = labels.shape[0] // self._sp
        return labels[self._rank * per_rank:(self._rank + 1) * per_rank]

    def _pad_to(self) -> int:
        return -(-self.n_tokens // self._sp) * self._sp

    def logits(self) -> torch.Tensor:
        return self._gather(self.local.logits())

    def logprobs(self, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        return self._gather(self.local.logprobs(self._local_labels(labels), temperature))

    def logprobs_entropy(self, labels: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        logp, entropy = self.local.logprobs_entropy(self._local_labels(labels), temperature)
        return self._gather(logp), self._gather(entropy)


class SequenceParallel:
    """A sequence-parallel group's split of packed micro-batches (see the module's docstring)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def token_range(self, n_tokens: int) -> slice:
        """This rank's consecutive share of a micro-batch of ``n_tokens`` tokens, in the row padded
        to a multiple of the group size (it may reach past ``n_tokens``)."""
        per_rank = -(-n_tokens // self.size)
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    def local_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor | None,
                     max_length: int | None = None) -> tuple[dict[str, torch.Tensor | int], int]:
        """The model's keyword inputs on this rank for a packed row of ``T`` tokens, and ``T``.

        The row is padded to a multiple of the group size with pad tokens that form a sequence of
        their own (so they attend only to each other); this rank gets its consecutive share of
        ``input_ids`` and ``position_ids`` and the whole padded row's boundaries
        (``cu_seq_lens_q``) and longest sequence (``max_length_q``, from ``max_length`` of the
        unpadded row). ``position_ids`` is ``[T]`` (given as ``[1, T/sp]``) or ``[k, T]``, rows of
        positions such as Qwen2.5-VL's text and 3-D ones (given as ``[k, 1, T/sp]``).
        """
        T = input_ids.shape[-1]
        share = self.token_range(T)
        n_pad = (share.stop - share.start) * self.size - T
        if n_pad:
            input_ids = torch.cat([input_ids, input_ids.new_zeros(n_pad)])
            pad_pos = torch.arange(n_pad, dtype=position_ids.dtype, device=position_ids.device)
            position_ids = torch.cat([position_ids, pad_pos.expand(*position_ids.shape[:-1], n_pad)], dim=-1)
            if cu_seqlens is not None:
                cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([T + n_pad])])
        local_pos = position_ids[..., share]
        kwargs = {"input_ids": input_ids[share][None],
                  "position_ids": local_pos[None] if local_pos.dim() == 1 else local_pos[:, None]}
        if cu_seqlens is not None:
            kwargs["cu_seq_lens_q"] = cu_seqlens
        if max_length is not None:
            kwargs["max_length_q"] = max(max_length, n_pad)
        return kwargs, T

    def local_share(self, x: torch.Tensor, fill: int = -1) -> torch.Tensor:
        """This rank's share of a per-token tensor ``[T, ...]`` of a micro-batch (padded with
        ``fill`` as `local_inputs` pads the row), e.g. the routing a MoE forward replays."""
        return token_share(x, self.size, self.rank, fill)

    def whole(self, local, n_tokens: int) -> SequenceParallelHead:
        """The whole micro-batch's `HeadOutput` from this rank's ``local`` one."""
        return SequenceParallelHead(local, self.group, n_tokens)
