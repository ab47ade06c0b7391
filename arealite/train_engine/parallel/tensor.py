"""Tensor parallelism for Llama/Qwen2/Qwen3/Mistral-style decoder layers (DTensor).

In each decoder layer the query, key, value, gate and up projections are split by output
features over the ``tp`` ranks (column-wise: each rank computes its own heads and its own slice
of the MLP's width) and the output and down projections by input features (row-wise: each rank's
partial product, summed over the ranks). Attention therefore runs on each rank's ``heads / tp``
query heads and ``kv_heads / tp`` KV heads, on all tokens, with any packed attention
implementation. Embeddings, norms and the output head stay whole on every tensor-parallel rank
(FSDP2 shards them over the data-parallel ranks), so the fused log-prob head is unchanged.

A per-head norm (Qwen3's ``q_norm`` / ``k_norm``, applied to each head right after its
projection) is whole on every rank too, but each rank applies it to its own heads only, so each
rank's gradient of its weight is a part of the whole: the norm is made a replicated DTensor
that takes its input as sharded over the heads (``SequenceParallel`` over the head dimension),
and DTensor sums the ranks' parts in backward. Any other parameter of a layer's attention or MLP
that the plan does not split is refused, rather than trained on a part of its gradient. The
parameters become DTensors on the data x tensor mesh once FSDP2 shards the layers over ``dp``;
``full_tensor()`` gathers a weight whole, which is how every weight transfer gets full tensors.

A mixture-of-experts layer (Qwen3-MoE) splits its attention the same way; its MoE block (the
router and the experts) is not split by features: each tensor-parallel rank runs it on its share
of the tokens (`arealite.train_engine.parallel.moe_tokens`), the experts split by expert
parallelism when ``ep_size > 1`` (`arealite.train_engine.parallel.experts`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from arealite.config.problems import ConfigProblem

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["TP_MODEL_TYPES", "apply_tensor_parallel", "tensor_parallel_problems", "whole_tensor"]

#: Model families whose decoder layers have the projections `_LAYER_PLAN` names, in that layout.
TP_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")

_COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROW = ("self_attn.o_proj", "mlp.down_proj")
#: Norms applied to each head after its projection: ``[..., heads, head_dim]``, heads at dim 2.
_PER_HEAD = ("self_attn.q_norm", "self_attn.k_norm")
#: A mixture-of-experts block's router and experts (split by tokens, not features: `moe_tokens`).
_MOE_BLOCK = ("mlp.gate.", "mlp.experts.")


def tensor_parallel_problems(hf_config: dict, tp: int, field: str) -> list[ConfigProblem]:
    """Why a model (its config.json as a dict) cannot be split over ``tp`` ranks (``field`` is
    the config field that asks for it)."""
    model_type = hf_config.get("model_type")
    if model_type not in TP_MODEL_TYPES:
        return [ConfigProblem(field, f"tensor parallelism knows the decoder layers of {', '.join(TP_MODEL_TYPES)} "
                              f"models, and this model is {model_type!r}; set {field}=1 (FSDP2 alone, or "
                              "sp_size)", tp)]
    problems = []
    sizes = {"num_attention_heads": hf_config.get("num_attention_heads"),
             "num_key_value_heads": hf_config.get("num_key_value_heads") or hf_config.get("num_attention_heads"),
             "intermediate_size": hf_config.get("intermediate_size")}
    for name, n in sizes.items():
        if isinstance(n, int) and n % tp:
            problems.append(ConfigProblem(field, f"does not divide the model's {name}={n}; pick a divisor of it", tp))
    return problems


def apply_tensor_parallel(layers: list[torch.nn.Module], tp_mesh: DeviceMesh) -> None:
    """Split each of ``layers`` (a model's decoder layers) over ``tp_mesh`` in place; the rest of
    the model stays whole."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    styles = {**{name: ColwiseParallel for name in _COLUMN}, **{name: RowwiseParallel for name in _ROW}}
    for layer in layers:
        _refuse_unplanned(layer)
        plan = {name: style() for name, style in styles.items() if _has_submodule(layer, name)}
        plan.update({name: SequenceParallel(sequence_dim=2, use_local_output=True)
                     for name in _PER_HEAD if _has_submodule(layer, name)})
        parallelize_module(layer, tp_mesh, plan)


def _has_submodule(module: torch.nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def _refuse_unplanned(layer: torch.nn.Module) -> None:
    """Raise if the layer's attention or MLP holds a parameter the plan neither splits nor knows
    as per-head: it would see only this rank's heads (or width) and train on a part of its gradient."""
    known = _COLUMN + _ROW + _PER_HEAD
    for name, _ in layer.named_parameters():
        owner = name.rsplit(".", 1)[0]
        if f"{owner}.".startswith(_MOE_BLOCK):  # whole on every tensor-parallel rank, on its share of the tokens
            continue
        if owner.startswith(("self_attn", "mlp")) and owner not in known:
            raise NotImplementedError(
                f"tensor parallelism does not know the decoder layer's parameter {name!r} "
                f"({type(layer).__name__}); set tp_size=1 for this model")


@contextlib.contextmanager
def _quiet_redistribute() -> Iterator[None]:
    """DTensor logs a warning each time it gathers a tensor-parallel weight that FSDP2 also
    shards (two all-gathers, one per mesh dimension, which it cannot merge): expected here, and
    a weight push gathers every weight."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole on this rank: a DTensor gathered from every mesh it is split over (a
    collective), a plain tensor as it is."""
    if not hasattr(t, "full_tensor"):
        return t
    with _quiet_redistribute():
        return t.full_tensor()
