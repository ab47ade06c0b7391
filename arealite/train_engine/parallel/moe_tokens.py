"""Tensor parallelism of a mixture-of-experts block: each tensor-parallel rank routes 1/tp of the tokens.

Tensor parallelism splits attention by heads, but a MoE block (its router and its experts) is not
split by features: without this module every tensor-parallel rank would run the whole block on
the same tokens, and its activations and its experts' work would not shrink with ``tp``. Its
tokens are independent of each other, so instead each tensor-parallel rank runs the block on its
consecutive share of them (the block's input ``[N, H]``, identical on the ``tp`` ranks, padded
to a multiple of ``tp``), and the output is gathered over the ``tp`` ranks. With expert
parallelism the experts' all-to-alls run on that share, over the ranks of the same
tensor-parallel position (`experts`).

The gradient bookkeeping, per rank:

- The gather's backward keeps this rank's rows of the (identical) output gradient; the split's
  backward all-gathers the input gradient, so the residual stream's gradient is whole and
  identical on every tensor-parallel rank, as the rest of the layer expects.
- The block's parameters outside an `ExpertShard` (the router, and the experts when they are not
  split by expert parallelism) are whole on every tensor-parallel rank and FSDP2 reduces them
  over the data x sequence ranks only; each tensor-parallel rank's gradient covers its share of
  the tokens, so `finish_moe_gradients` sums it over the ``tp`` ranks after the backward (one
  all-reduce per parameter per step, where a replicated DTensor would reduce every micro-batch,
  and the router's top-k needs no DTensor rule).
- An `ExpertShard`'s gradient already sums the tokens of its expert group; summed over the
  ranks holding the same experts it covers every token once (no tensor-parallel duplicate), each
  with the loss's scale, the ``dp x sp`` ranks FSDP2 averages over (`experts.finish_expert_gradients`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from arealite.train_engine.parallel.experts import ExpertShard, moe_experts
from arealite.train_engine.parallel.sequence import gather_tokens, token_share

__all__ = ["MoeTokenSplit", "finish_moe_gradients", "split_moe_tokens"]


class _SplitTokens(torch.autograd.Function):
    """This rank's consecutive rows of ``x`` (``[size * n, ...]``, the same on every rank of the
    group); the backward all-gathers the gradient, so that it is whole on every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.group, n = group, x.shape[0] // size
        return x[rank * n:(rank + 1) * n].clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None


class MoeTokenSplit:
    """The tensor-parallel ranks' split of a MoE block's tokens (see the module's docstring)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def local_share(self, x: torch.Tensor, fill: float = -1) -> torch.Tensor:
        """This rank's share of a per-token tensor ``[N, ...]`` of the block's input, e.g. the
        routing a forward replays (padding rows: ``fill``)."""
        return token_share(x, self.size, self.rank, fill)

    def attach(self, block: torch.nn.Module) -> None:
        """Make ``block`` (``hidden [B, S, H] -> [B, S, H]``) run on this rank's share of its tokens."""
        # The input's shape, from the pre-hook to the hook of the same call (one slot: a recompute
        # under activation checkpointing may stop inside the block, before the hook).
        shape_of_call: dict[str, torch.Size] = {}

        def split(module: torch.nn.Module, args: tuple) -> tuple:
            hidden = args[0]
            shape_of_call["input"] = hidden.shape
            flat = hidden.reshape(-1, hidden.shape[-1])
            n_pad = -flat.shape[0] % self.size
            if n_pad:
                flat = torch.cat([flat, flat.new_zeros(n_pad, flat.shape[1])])
            return (_SplitTokens.apply(flat, self.group)[None], *args[1:])

        def gather(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            shape = shape_of_call["input"]
            whole = gather_tokens(output.reshape(-1, shape[-1]), self.group)
            return whole[: shape[:-1].numel()].reshape(shape)

        block.register_forward_pre_hook(split)
        block.register_forward_hook(gather)


def split_moe_tokens(model: torch.nn.Module, group: dist.ProcessGroup) -> MoeTokenSplit | None:
    """Make each MoE block of ``model`` run on this rank's share of its tokens among ``group``
    (the tensor-parallel ranks); None for a model without MoE blocks."""
    blocks = moe_experts(model)
    if not blocks:
        return None
    splitter = MoeTokenSplit(group)
    for block, _, _ in blocks:
        splitter.attach(block)
    return splitter


def finish_moe_gradients(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """After a step's backward: sum over ``group`` (the tensor-parallel ranks) the gradients of
    each MoE block's parameters that every rank of it holds whole (all but an `ExpertShard`'s)."""
    for block, _, _ in moe_experts(model):
        shards = {id(p) for m in block.modules() if isinstance(m, ExpertShard) for p in m.parameters()}
        for p in block.parameters():
            if id(p) in shards or not p.requires_grad:
                continue
            if p.grad is None:  # no token reached it here: every rank must join the all-reduce
                p.grad = torch.zeros_like(p)
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(grad, group=group)
