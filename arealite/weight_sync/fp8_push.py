"""The trainer's side of FP8 rollout (`server.quantization: fp8`): quantise on the push, and
score the probe with the weights the servers hold.

The servers keep the linear layers' weights as block-wise float8_e4m3fn with a float32
``weight_scale_inv`` per 128x128 block (`arealite.quant.fp8`); SGLang copies what it is
sent into those parameters without quantising bf16 on the way in (docs/sglang.md, "FP8
weights"). So the trainer sends what an FP8 checkpoint holds, under its names:

- `Fp8Source` wraps the engine's weight buckets: each bucket's quantised weights become the
  pair ``x.weight`` (FP8) + ``x.weight_scale_inv`` (float32), bucket by bucket, the rest
  goes as it is. Every transfer (distributed, disk, shm) reads it like any other source,
  and the read-back check compares the FP8 values the servers hold with these.
- `fp8_rounded_weights` rounds the engine's own weights to the values those blocks stand
  for for the length of a forward (then puts the trainer's weights back), so that the
  log-prob probe compares a server with the trainer's forward *on the same FP8-rounded
  weights*: a correct push agrees to float32 round-off, a wrong one (a wrong scale, a
  block cut differently) does not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from arealite.api.contracts import WeightSource
from arealite.quant.fp8 import dequantize_blockwise, fp8_checkpoint_tensors, quantize_blockwise, stays_unquantised
from arealite.utils.checkpoint_names import checkpoint_views

__all__ = ["Fp8Source", "fp8_rounded_scorer", "fp8_rounded_weights", "round_to_fp8"]


class Fp8Source:
    """A `WeightSource` that gives `source`'s buckets as an FP8 checkpoint holds them.

    Reading stays collective and in step: every bucket of `source` is read once, in order
    (ranks other than 0 drain it the same way)."""

    def __init__(self, source: WeightSource):
        self.source = source

    def named_weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        for bucket in self.source.named_weight_buckets(bucket_bytes):
            yield [pair for name, t in bucket for pair in fp8_checkpoint_tensors(name, t)]


def round_to_fp8(w: torch.Tensor) -> torch.Tensor:
    """`w` (2-D) as the FP8 server holds it: quantised block-wise and de-quantised, in `w`'s dtype."""
    q, scale_inv = quantize_blockwise(w)
    return dequantize_blockwise(q, scale_inv, dtype=w.dtype)


def _full(p: torch.Tensor) -> torch.Tensor:
    """The whole parameter (a collective for a sharded DTensor)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def _write(p: torch.Tensor, full: torch.Tensor) -> None:
    """Write the whole tensor `full` into `p` (into this rank's shard of a DTensor)."""
    if hasattr(p, "full_tensor"):
        from torch.distributed.tensor import distribute_tensor

        p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
    else:
        p.data.copy_(full)


@contextlib.contextmanager
@torch.no_grad()
def fp8_rounded_weights(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, `model`'s weights that an FP8 server quantises hold their FP8-rounded
    values; the trainer's own values are restored after (also on error).

    Blocks are cut as the servers cut them: on each checkpoint tensor (one expert's
    projection of a fused MoE parameter, `arealite.utils.checkpoint_names`). Every rank of a
    sharded model must enter it together (gathering a parameter is a collective)."""
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        for name, p in model.named_parameters():
            full = _full(p)
            views = checkpoint_views(model, {name: full})
            targets = [v for n, v in views.items() if not stays_unquantised(n, v)]
            if not targets:
                continue
            full = full.clone()  # a plain parameter's full tensor is the parameter itself
            views = checkpoint_views(model, {name: full})
            for n, v in views.items():
                if not stays_unquantised(n, v):
                    v.copy_(round_to_fp8(v))
            local = p.to_local() if hasattr(p, "to_local") else p.data
            saved.append((p, local.clone()))
            _write(p, full)
        yield
    finally:
        for p, local in saved:
            (p.to_local() if hasattr(p, "to_local") else p.data).copy_(local)


def fp8_rounded_scorer(model: torch.nn.Module, score: Callable[[list[int]], list[float]]
                       ) -> Callable[[list[int]], list[float]]:
    """`score` (the trainer's probe forward) run on `model` with FP8-rounded weights."""

    def rounded(ids: list[int]) -> list[float]:
        with fp8_rounded_weights(model):
            return score(ids)

    return rounded
