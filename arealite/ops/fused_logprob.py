"""Log-probs and entropies straight from the last hidden states: the output head applied in chunks.

``fused_logprobs_entropy(hidden [T, H], weight [V, H], bias, labels [T], temperature)`` returns,
in float32, the log-prob of each label under ``log_softmax((hidden @ weight.T + bias) / T)`` and
the entropy of that distribution, without ever holding the ``[T, V]`` logits: the forward runs
the head over ``chunk`` rows at a time and keeps one log-sum-exp per row; the backward
recomputes each chunk's logits and turns them into the gradients of ``hidden``, ``weight`` and
``bias`` (the weight's accumulated over chunks in float32). Peak memory is about two
``[chunk, V]`` float32 buffers, allocated once per call and reused by every chunk, whatever T is.

With ``weight=None`` the "hidden states" are the logits themselves (``[T, V]``) and the same
chunked pass scores them (a value head, a loss that materialised its logits, and every function of
`arealite.algo.logprob`, which are thin wrappers over this one): then only the gradient of the
logits is returned, and masked (``-inf``) logits are allowed.

Gradients, with ``z`` the tempered logits, ``p = softmax(z)``, ``H`` the entropy and ``y`` the
label: ``d logp / dz = onehot(y) - p`` and ``dH / dz = -p * (log p + H)``; ``d/dlogits = d/dz / T``.
This is also how inference engines score a sampled token (``log_softmax(logits / T)`` over the
full vocabulary, in float32 whatever the logits' dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["DEFAULT_CHUNK_BYTES", "chunk_rows", "fused_logprobs_entropy"]

#: Bytes of one float32 ``[chunk, V]`` logits chunk the default chunk size aims at.
DEFAULT_CHUNK_BYTES = 256 << 20


def chunk_rows(vocab: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rows per chunk so that one float32 chunk of logits takes about ``chunk_bytes`` (at least 16)."""
    return max(16, chunk_bytes // (4 * max(1, vocab)))


def _logits_into(out: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 temperature: float) -> torch.Tensor:
    """Write one chunk's tempered float32 logits into ``out`` (a reused buffer) and return it."""
    if weight is None:
        out.copy_(hidden)
    elif weight.dtype == torch.float32 and hidden.dtype == torch.float32:
        torch.mm(hidden, weight.t(), out=out)
        if bias is not None:
            out.add_(bias)
    else:
        out.copy_(F.linear(hidden, weight, bias))  # low-precision logits, as the model's head makes them
    return out if temperature == 1.0 else out.div_(temperature)


def _row_dot_(p: torch.Tensor, z: torch.Tensor, masked: bool) -> torch.Tensor:
    """``sum_v p * z`` per row, with no ``[chunk, V]`` temporary; with ``masked`` a ``-inf`` logit
    (p = 0) adds 0, not NaN, and ``p`` is overwritten (the product is taken in place)."""
    if masked:
        return p.mul_(z).nansum(-1)
    return torch.bmm(p[:, None, :], z[:, :, None]).view(-1)


def _grad_logits_(z: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, g_logp: torch.Tensor,
                  g_ent: torch.Tensor | None, ent: torch.Tensor | None, p_buf: torch.Tensor | None,
                  masked: bool) -> torch.Tensor:
    """``d loss / dz`` of one chunk, written over the tempered logits ``z``; the upstream gradients
    ``g_*`` come already divided by the temperature (which makes this ``d loss / d logits``)."""
    logp = z.sub_(lse[:, None])
    if g_ent is None:
        gz = logp.exp_().mul_(-g_logp[:, None])  # -p * g
    else:
        p = torch.exp(logp, out=p_buf)
        # -p * (g_logp + g_ent * (log p + H))
        gz = logp.add_(ent[:, None]).mul_(g_ent[:, None]).add_(g_logp[:, None]).mul_(p).neg_()
        if masked:
            gz.masked_fill_(p == 0, 0.0)  # p = 0 at a -inf logit: 0, not 0 * inf
    return gz.scatter_add_(-1, labels[:, None], g_logp[:, None])


def _buffer(rows: int, vocab: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(rows, vocab, dtype=torch.float32, device=like.device)


class _FusedHeadLogprob(torch.autograd.Function):
    """See the module's docstring. Outputs ``(logp [T], entropy [T])``, float32; the entropy is
    empty unless ``with_entropy``. The ``[chunk, V]`` buffers are allocated once per call."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk, with_entropy):
        n = hidden.shape[0]
        vocab = hidden.shape[1] if weight is None else weight.shape[0]
        f32 = {"dtype": torch.float32, "device": hidden.device}
        logp, lse = torch.empty(n, **f32), torch.empty(n, **f32)
        ent = torch.empty(n if with_entropy else 0, **f32)
        z_buf, p_buf = _buffer(min(chunk, n), vocab, hidden), _buffer(min(chunk, n), vocab, hidden)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z = _logits_into(z_buf[: e - s], hidden[s:e], weight, bias, temperature)
            m = z.amax(-1, keepdim=True)
            z.sub_(m)  # <= 0: log p and the entropy without cancellation against a large max
            p = torch.exp(z, out=p_buf[: e - s])  # unnormalised
            total = p.sum(-1)
            log_total = total.log()
            lse[s:e] = m.view(-1) + log_total
            logp[s:e] = z.gather(-1, labels[s:e, None]).view(-1) - log_total
            if with_entropy:
                ent[s:e] = log_total - _row_dot_(p, z, weight is None) / total  # the chunk's last use of p
        del z_buf, p_buf
        ctx.save_for_backward(hidden, weight, bias, labels, lse, ent)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, labels, lse, ent = ctx.saved_tensors
        if g_logp is None and g_ent is None:
            return None, None, None, None, None, None, None
        n, T = hidden.shape[0], ctx.temperature
        g_logp = torch.zeros(n, dtype=torch.float32, device=hidden.device) if g_logp is None else g_logp.float() / T
        g_ent = None if g_ent is None or ent.numel() == 0 else g_ent.float() / T
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        rows = min(ctx.chunk, n)
        vocab = hidden.shape[1] if weight is None else weight.shape[0]
        z_buf = _buffer(rows, vocab, hidden)
        p_buf = None if g_ent is None else _buffer(rows, vocab, hidden)
        for s in range(0, n, ctx.chunk):
            e = min(n, s + ctx.chunk)
            z = _logits_into(z_buf[: e - s], hidden[s:e], weight, bias, T)
            gz = _grad_logits_(z, lse[s:e], labels[s:e], g_logp[s:e], None if g_ent is None else g_ent[s:e],
                               None if g_ent is None else ent[s:e], None if p_buf is None else p_buf[: e - s],
                               masked=weight is None)
            if weight is None:
                grad_h[s:e] = gz  # copies (and casts) into the logits' dtype
            else:
                _accumulate(gz, hidden[s:e], weight, None if grad_h is None else grad_h[s:e], grad_w, grad_b)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None


def _accumulate(gz: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, grad_h: torch.Tensor | None,
                grad_w: torch.Tensor | None, grad_b: torch.Tensor | None) -> None:
    """One chunk's share of the head's gradients: ``grad_h = gz @ W`` (this chunk's rows), and
    ``gz.T @ h`` and ``sum(gz)`` added to the float32 ``grad_w`` and ``grad_b``."""
    if grad_b is not None:
        grad_b += gz.sum(0)
    g = gz.to(weight.dtype)  # low-precision products, as the model's own head backward makes them
    if grad_h is not None:
        if grad_h.dtype == weight.dtype:
            torch.mm(g, weight, out=grad_h)
        else:
            grad_h.copy_(g @ weight)
    if grad_w is not None:
        if g.dtype == torch.float32 and hidden.dtype == torch.float32:
            grad_w.addmm_(g.t(), hidden)  # no [V, H] temporary
        else:
            grad_w += g.t() @ hidden.to(g.dtype)  # float32 sum over chunks


def fused_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, entropy)`` of ``softmax((hidden @ weight.T + bias) / temperature)`` at ``labels``.

    ``hidden [..., H]``, ``weight [V, H]`` (``None``: ``hidden`` are the logits ``[..., V]``),
    ``labels [...]`` integer ids -> two float32 ``[...]`` tensors (the entropy is empty ``[0]``
    without ``with_entropy``). Both carry gradients to ``hidden``, ``weight`` and ``bias``.
    ``chunk_size``: rows per chunk (default `chunk_rows` of the vocabulary).
    """
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature must be a positive number, got {temperature!r}; greedy decoding "
                         "(temperature 0) has no log-probs to recompute, use 1.0")
    if labels.dtype.is_floating_point:
        raise TypeError(f"labels must be integer token ids, got dtype {labels.dtype}")
    what = "logits" if weight is None else "hidden states"
    if hidden.dim() < 1 or tuple(hidden.shape[:-1]) != tuple(labels.shape):
        raise ValueError(f"{what} of shape {tuple(hidden.shape)} need labels of shape "
                         f"{tuple(hidden.shape[:-1])}, got labels of shape {tuple(labels.shape)}")
    if weight is not None and weight.shape[-1] != hidden.shape[-1]:
        raise ValueError(f"head weight {tuple(weight.shape)} does not take hidden states of size {hidden.shape[-1]}")
    vocab = hidden.shape[-1] if weight is None else weight.shape[0]
    chunk = chunk_rows(vocab) if chunk_size is None else int(chunk_size)
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1 (or None), got {chunk_size}")
    lead = labels.shape
    logp, ent = _FusedHeadLogprob.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias,
                                        labels.reshape(-1).long(), float(temperature), chunk, bool(with_entropy))
    return logp.view(lead), (ent.view(lead) if with_entropy else ent)
