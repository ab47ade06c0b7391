"""Token log-probabilities (and entropies) from logits, the way inference engines compute them.

SGLang reports for a sampled token ``log_softmax(logits / T)`` over the full
vocabulary, before any top-p/top-k truncation. The trainer must recompute the
very same quantity, so everything here divides by the temperature and works
in float32 whatever the dtype of the logits.

``gather_logprobs(..., chunk_size=n)`` is the memory-lean form: it never holds
a float32 copy of more than ``n`` rows of the ``[T, V]`` logits, in the forward
nor in the backward (which recomputes the softmax chunk by chunk from the saved
logits and log-sum-exp instead of keeping ``[T, V]`` activations).
"""

from __future__ import annotations

import torch

__all__ = ["gather_logprobs", "gather_logprobs_entropy", "gather_logprobs_entropy_stat", "token_entropy"]


def _check(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> None:
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(
            f"temperature must be a positive number, got {temperature!r}; "
            "greedy decoding (temperature 0) has no log-probs to recompute, use 1.0"
        )
    if logits.dim() < 1 or tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} need labels of shape "
            f"{tuple(logits.shape[:-1])}, got labels of shape {tuple(labels.shape)}"
        )
    if labels.dtype.is_floating_point:
        raise TypeError(f"labels must be integer token ids, got dtype {labels.dtype}")


class _ChunkedLogprob(torch.autograd.Function):
    """log_softmax(z / T) gathered at labels, with a chunked forward and backward.

    Saves only the logits (which the caller holds anyway) and one log-sum-exp
    per row; the backward rebuilds ``softmax`` chunk by chunk:
    d logp[i] / d z[i, v] = (onehot(label_i)[v] - p[i, v]) / T.
    """

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_size, with_entropy):
        n = logits.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        # The entropy as a by-product (a stat, no gradient): lse - sum(p * z) from the same chunk.
        ent = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=logits.device)
        for s in range(0, n, chunk_size):
            z = _tempered(logits[s : s + chunk_size], temperature)
            lse_c = torch.logsumexp(z, dim=-1)
            lse[s : s + chunk_size] = lse_c
            out[s : s + chunk_size] = z.gather(-1, labels[s : s + chunk_size, None]).squeeze(-1) - lse_c
            if with_entropy:
                p = torch.exp(z - lse_c[:, None])
                # nansum: a -inf logit has p = 0 and contributes 0 (0 * -inf is NaN).
                ent[s : s + chunk_size] = lse_c - (p * z).nansum(-1)
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, _grad_ent):
        logits, labels, lse = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk_size
        grad = torch.empty_like(logits)
        grad_out = grad_out.float()
        for s in range(0, logits.shape[0], chunk):
            z = _tempered(logits[s : s + chunk], T)
            g = grad_out[s : s + chunk] if T == 1.0 else grad_out[s : s + chunk] / T
            gz = torch.exp(z - lse[s : s + chunk, None]).mul_(-g[:, None])
            gz.scatter_add_(-1, labels[s : s + chunk, None], g[:, None])
            grad[s : s + chunk] = gz  # copies (and casts) into the logits' dtype
        return grad, None, None, None, None


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / T`` in float32; no copy for float32 logits at T = 1."""
    z = logits.float()
    return z if temperature == 1.0 else z / temperature


def gather_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Log-prob of ``labels`` under ``log_softmax(logits / temperature)``, in float32.

    ``logits [..., V]``, ``labels [...]`` -> ``[...]`` float32. With ``chunk_size``
    the rows are processed ``chunk_size`` at a time (same values and gradients,
    far less memory for a large vocabulary).
    """
    _check(logits, labels, temperature)
    lead = labels.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1).long()
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 (or None), got {chunk_size}")
        out, _ = _ChunkedLogprob.apply(flat_logits, flat_labels, float(temperature), int(chunk_size), False)
    else:
        logp = torch.log_softmax(flat_logits.float() / temperature, dim=-1)
        out = logp.gather(-1, flat_labels[:, None]).squeeze(-1)
    return out.reshape(lead)


def gather_logprobs_entropy_stat(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gather_logprobs(..., chunk_size)`` and, without a gradient, the entropy of each row.

    The entropy comes from the same chunked pass (the softmax is at hand), for stats:
    cheaper than a separate ``token_entropy``. For an entropy *bonus* (with gradient)
    use ``gather_logprobs_entropy``.
    """
    _check(logits, labels, temperature)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    lead = labels.shape
    out, ent = _ChunkedLogprob.apply(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).long(),
                                     float(temperature), int(chunk_size), True)
    return out.reshape(lead), ent.reshape(lead)


def gather_logprobs_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, entropy)`` of ``softmax(logits / temperature)``, both float32 ``[...]``.

    The entropy is that of the full (tempered) next-token distribution at each row.
    """
    _check(logits, labels, temperature)
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    # sum p * log p with p = exp(log p). A -inf logit (a masked vocabulary entry) has p = 0
    # and must add 0 to the value *and* to the gradient: zero log p there before the product,
    # else the backward of p * log p computes 0 * -inf = NaN even where the value was masked.
    p = logp_all.exp()
    safe_logp = torch.where(p > 0, logp_all, torch.zeros_like(logp_all))
    entropy = -(p * safe_logp).sum(-1)
    return logp, entropy


def token_entropy(logits: torch.Tensor, temperature: float = 1.0, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy ``[...]`` of ``softmax(logits / temperature)`` at each row, float32.

    With ``chunk_size`` only that many rows are in float32 at once; meant for
    stats under ``torch.no_grad()`` (with gradients every chunk is kept anyway).
    """
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    step = flat.shape[0] if chunk_size is None else int(chunk_size)
    if step < 1:
        step = 1
    parts = []
    for s in range(0, flat.shape[0], step):
        logp_all = torch.log_softmax(flat[s : s + step].float() / temperature, dim=-1)
        p = logp_all.exp()
        parts.append(-(p * torch.where(p > 0, logp_all, torch.zeros_like(logp_all))).sum(-1))
    out = torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.float32)
    return out.reshape(lead)
