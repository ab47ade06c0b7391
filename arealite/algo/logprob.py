"""Token log-probabilities (and entropies) from logits, the way inference engines compute them.

SGLang reports for a sampled token ``log_softmax(logits / T)`` over the full
vocabulary, before any top-p/top-k truncation. The trainer must recompute the
very same quantity, so everything here divides by the temperature and works
in float32 whatever the dtype of the logits.

Each function is a thin wrapper over the one chunked kernel,
`arealite.ops.fused_logprob.fused_logprobs_entropy` with ``weight=None`` (the
train engine runs the same kernel on its hidden states and output head). It
never holds a float32 copy of more than ``chunk_size`` rows of the ``[T, V]``
logits, in the forward nor in the backward (which recomputes the softmax chunk
by chunk from the saved logits and one log-sum-exp per row); ``chunk_size=None``
is the kernel's default, about 256 MiB of float32 logits per chunk. Masked
(``-inf``) logits have probability 0 and add 0 to entropies and gradients.
"""

from __future__ import annotations

import torch

from arealite.ops.fused_logprob import fused_logprobs_entropy

__all__ = ["gather_logprobs", "gather_logprobs_entropy", "gather_logprobs_entropy_stat", "token_entropy"]


def gather_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Log-prob of ``labels`` under ``log_softmax(logits / temperature)``, in float32.

    ``logits [..., V]``, ``labels [...]`` -> ``[...]`` float32, with gradient to the
    logits. ``chunk_size``: rows per chunk (the values do not depend on it).
    """
    logp, _ = fused_logprobs_entropy(logits, None, labels, temperature, chunk_size=chunk_size, with_entropy=False)
    return logp


def gather_logprobs_entropy_stat(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gather_logprobs(..., chunk_size)`` and, without a gradient, the entropy of each row.

    The entropy comes from the same chunked pass, for stats; the backward then
    computes the log-probs' gradient alone. For an entropy *bonus* (with gradient)
    use ``gather_logprobs_entropy``.
    """
    logp, entropy = fused_logprobs_entropy(logits, None, labels, temperature, chunk_size=chunk_size)
    return logp, entropy.detach()


def gather_logprobs_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, entropy)`` of ``softmax(logits / temperature)``, both float32 ``[...]``
    and both with gradient. The entropy is that of the full (tempered) next-token
    distribution at each row."""
    return fused_logprobs_entropy(logits, None, labels, temperature, chunk_size=chunk_size)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy ``[...]`` of ``softmax(logits / temperature)`` at each row, float32, with gradient."""
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)  # any label: logp unused
    _, entropy = fused_logprobs_entropy(logits, None, labels, temperature, chunk_size=chunk_size)
    return entropy
