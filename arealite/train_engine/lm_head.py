"""What a train engine hands a loss function: the model's output head, applied only when asked.

`ChunkedHead` satisfies `arealite.api.contracts.HeadOutput`. Built from the last hidden states
and the head's weight, ``logprobs``/``logprobs_entropy`` run the fused chunked head
(`arealite.ops.fused_logprob`): the ``[T, V]`` logits never exist. ``logits()``
materialises them for a loss that needs them. Built from logits (`ChunkedHead.from_logits`: a
value model's ``[T, 1]``, a head the fused path cannot reproduce), every method works on those.

`capture_head` runs the model's forward with the output head skipped and returns the
`ChunkedHead` of what the head would have consumed. It hooks the head module itself, so the
model's own forward (and FSDP2's hooks around it) runs unchanged, and the weight it reads is the
one the forward used: under FSDP2 the gathered (unsharded) parameter of the root module, which
must stay gathered until the backward (the engine keeps the root from resharding after forward,
FSDP2's own default for the root). Tied embeddings share that parameter; a PEFT LoRA adapter on
the head is folded into the weight (``W + B @ A * scaling``) when it runs without dropout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from arealite.ops.fused_logprob import fused_logprobs_entropy

__all__ = ["ChunkedHead", "capture_head", "head_params", "output_head"]

#: Config fields of Hugging Face models whose forward changes the logits after the head
#: (softcapping, scaling): the fused path would not reproduce them, so those models materialise.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


class ChunkedHead:
    """The output head of one packed micro-batch, applied lazily (see the module's docstring).

    ``hidden [..., H]`` with ``weight [V, H]`` (and ``bias [V]``), or, with ``weight=None``,
    ``hidden`` are the logits ``[..., V]``. ``chunk_size``: rows per chunk (default: about
    256 MiB of float32 logits per chunk).
    """

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 chunk_size: int | None = None):
        self.hidden, self.weight, self.bias, self.chunk_size = hidden, weight, bias, chunk_size

    @classmethod
    def from_logits(cls, logits: torch.Tensor, chunk_size: int | None = None) -> "ChunkedHead":
        """A head whose output is already there (``logits [..., V]``)."""
        return cls(logits, None, None, chunk_size)

    @property
    def fused(self) -> bool:
        """Whether log-probs come from the hidden states without materialised logits."""
        return self.weight is not None

    def logits(self) -> torch.Tensor:
        """The logits ``[..., V]`` in float32 (materialised: ``T x V`` of memory, with their graph)."""
        if self.weight is None:
            return self.hidden.float()
        return F.linear(self.hidden, self.weight, self.bias).float()

    def logprobs(self, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Log-prob ``[...]`` (float32) of ``labels`` under ``log_softmax(logits / temperature)``."""
        logp, _ = fused_logprobs_entropy(self.hidden, self.weight, labels, temperature, bias=self.bias,
                                         chunk_size=self.chunk_size, with_entropy=False)
        return logp

    def logprobs_entropy(self, labels: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logprobs, entropy)`` of ``softmax(logits / temperature)``, float32 ``[...]``, both with gradient."""
        return fused_logprobs_entropy(self.hidden, self.weight, labels, temperature, bias=self.bias,
                                      chunk_size=self.chunk_size, with_entropy=True)


def output_head(model: torch.nn.Module, hf_config: object | None = None) -> torch.nn.Module | None:
    """The output head module of a HF causal LM (PEFT-wrapped or not), or None where the fused
    path does not apply: no ``lm_head`` (a value model) or logits transformed after the head."""
    if hf_config is not None and any(getattr(hf_config, k, None) not in (None, 1.0) for k in _LOGIT_TRANSFORMS):
        return None
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, torch.nn.Module) else None


def head_params(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight [V, H], bias)`` that compute ``module``'s output as ``F.linear``, as it runs now
    (adapters on or off), or None when it is not such a layer (then its output is materialised)."""
    if type(module) is torch.nn.Linear:
        return module.weight, module.bias
    return _lora_params(module)


def _lora_params(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A PEFT ``lora.Linear`` over an ``nn.Linear`` as one linear layer: the base weight plus each
    active plain adapter's ``B @ A * scaling`` (graph kept, so A and B get their gradients)."""
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:  # peft is optional
        return None
    if not isinstance(module, LoraLinear) or type(module.base_layer) is not torch.nn.Linear:
        return None
    base = module.base_layer
    if module.disable_adapters or module.merged:
        return base.weight, base.bias
    weight = base.weight
    for name in module.active_adapters:
        if name not in module.lora_A.keys():
            continue
        a, b, dropout = module.lora_A[name], module.lora_B[name], module.lora_dropout[name]
        if (name in module.lora_variant or b.bias is not None or module.fan_in_fan_out
                or (dropout.training and getattr(dropout, "p", 0.0) > 0)):
            return None  # DoRA and other variants, a LoRA bias, active dropout: not one linear map
        weight = weight + (b.weight @ a.weight).to(weight.dtype) * module.scaling[name]
    return weight, base.bias


@contextmanager
def capture_head(head: torch.nn.Module, take: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                 chunk_size: int | None = None) -> Iterator[list[ChunkedHead]]:
    """While active, a call of ``head`` computes nothing and puts in the yielded list the
    `ChunkedHead` of its input (``take`` picks the rows: e.g. ``t[0]`` drops a batch dim of 1).
    A head that `head_params` cannot express runs as usual and its output is captured instead."""
    captured: list[ChunkedHead] = []

    def before(module: torch.nn.Module, args: tuple) -> tuple | None:
        params = head_params(module) if len(args) == 1 else None
        if params is None:
            return None
        captured.append(ChunkedHead(take(args[0]), *params, chunk_size=chunk_size))
        return (args[0][..., :0, :],)  # the model's own head call runs on no rows

    def after(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not captured:
            captured.append(ChunkedHead.from_logits(take(output).float(), chunk_size))

    handles = [head.register_forward_pre_hook(before), head.register_forward_hook(after)]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()
