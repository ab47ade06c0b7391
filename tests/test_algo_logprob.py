"""gather_logprobs / gather_logprobs_entropy / token_entropy (wrappers over the one chunked kernel,
`arealite.ops.fused_logprob`) against torch.distributions.Categorical and the plain float64
log-softmax: values and gradients, masked (-inf) logits, and row counts at a chunk edge."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Categorical

from arealite.algo.logprob import gather_logprobs, gather_logprobs_entropy, gather_logprobs_entropy_stat, token_entropy


def _rand(T=13, V=37, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, V, generator=g) * 3).to(dtype)
    labels = torch.randint(0, V, (T,), generator=g)
    return logits, labels


def plain_logprobs_entropy(logits, labels, temperature, dtype=torch.float32):
    """The plain formula, every ``[T, V]`` tensor materialised, autograd for the gradients:
    ``log_softmax(logits / T)`` at the labels and ``-sum p log p`` (a -inf logit adds 0)."""
    logp_all = torch.log_softmax(logits.to(dtype) / temperature, dim=-1)
    p = logp_all.exp()
    entropy = -(p * torch.where(p > 0, logp_all, torch.zeros_like(logp_all))).sum(-1)
    return logp_all.gather(-1, labels[..., None]).squeeze(-1), entropy


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_matches_categorical(temperature):
    logits, labels = _rand()
    ref = Categorical(logits=logits / temperature)
    got = gather_logprobs(logits, labels, temperature)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref.log_prob(labels), atol=1e-6, rtol=1e-6)
    lp, ent = gather_logprobs_entropy(logits, labels, temperature)
    torch.testing.assert_close(lp, ref.log_prob(labels), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent, ref.entropy(), atol=1e-5, rtol=1e-5)
    for chunk in (None, 1, 5):
        torch.testing.assert_close(token_entropy(logits, temperature, chunk), ref.entropy(), atol=1e-5, rtol=1e-5)


def test_bf16_logits_are_computed_in_fp32():
    logits, labels = _rand(dtype=torch.bfloat16)
    got = gather_logprobs(logits, labels, 0.9)
    ref = Categorical(logits=logits.float() / 0.9).log_prob(labels)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)


def test_leading_dims_are_kept():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 11, generator=g)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    got = gather_logprobs(logits, labels, 1.3)
    assert got.shape == (2, 5)
    for b in range(2):
        for t in range(5):
            ref = torch.log_softmax(logits[b, t] / 1.3, -1)[labels[b, t]]
            assert abs(float(got[b, t]) - float(ref)) < 1e-6


@pytest.mark.parametrize("chunk", [1, 4, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_matches_plain_values_and_gradients(chunk, dtype):
    logits, labels = _rand(T=10, V=29, seed=3, dtype=dtype)
    weights = torch.randn(10, generator=torch.Generator().manual_seed(4))
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    plain, _ = plain_logprobs_entropy(a, labels, 0.8)
    chunked = gather_logprobs(b, labels, 0.8, chunk_size=chunk)
    torch.testing.assert_close(chunked, plain, atol=1e-6, rtol=1e-6)
    (plain * weights).sum().backward()
    (chunked * weights).sum().backward()
    assert b.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(b.grad.float(), a.grad.float(), atol=tol, rtol=tol)


def test_chunked_gradient_is_onehot_minus_softmax():
    logits, labels = _rand(T=3, V=5, seed=5)
    x = logits.clone().requires_grad_(True)
    gather_logprobs(x, labels, 2.0, chunk_size=2).sum().backward()
    p = torch.softmax(logits / 2.0, -1)
    expected = (torch.nn.functional.one_hot(labels, 5).float() - p) / 2.0
    torch.testing.assert_close(x.grad, expected, atol=1e-6, rtol=1e-6)


def test_bad_inputs_are_named():
    logits, labels = _rand()
    with pytest.raises(ValueError, match="temperature"):
        gather_logprobs(logits, labels, 0.0)
    with pytest.raises(ValueError, match="labels of shape"):
        gather_logprobs(logits, labels[:-1], 1.0)
    with pytest.raises(TypeError, match="integer"):
        gather_logprobs(logits, labels.float(), 1.0)
    with pytest.raises(ValueError, match="chunk_size"):
        gather_logprobs(logits, labels, 1.0, chunk_size=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_stat_comes_with_the_chunked_logprobs(temperature, dtype):
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(37, 53, generator=g) * 3).to(dtype)
    logits[5, :50] = -float("inf")  # a row with (almost) all mass on three tokens
    labels = torch.randint(50, 53, (37,), generator=g)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    ref, ref_ent = plain_logprobs_entropy(a, labels, temperature)
    got, ent = gather_logprobs_entropy_stat(b, labels, temperature, chunk_size=8)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(ent, ref_ent.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, token_entropy(logits, temperature, chunk_size=8), rtol=0, atol=0)
    assert not ent.requires_grad and torch.isfinite(ent).all()
    w = torch.randn(37, generator=g)
    (ref * w).sum().backward()
    (got * w).sum().backward()
    torch.testing.assert_close(b.grad, a.grad)


@pytest.mark.parametrize("rows", [15, 16, 17])  # one under, at and one over a multiple of the chunk (8)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_every_wrapper_at_a_chunk_edge_with_masked_logits(rows, temperature):
    g = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, 23, generator=g) * 3
    logits[::4, 17:] = -float("inf")  # a masked vocabulary on some rows, the last chunk's included
    logits[-1, 17:] = -float("inf")
    labels = torch.randint(0, 17, (rows,), generator=g)
    a, c = torch.randn(rows, generator=g).double(), torch.randn(rows, generator=g).double()
    x = logits.double().requires_grad_(True)
    want_lp, want_ent = plain_logprobs_entropy(x, labels, temperature, torch.float64)
    want_lp_only, want_ent_only = (torch.autograd.grad(o, x, retain_graph=True)[0]
                                   for o in ((a * want_lp).sum(), (c * want_ent).sum()))
    want = want_lp_only + want_ent_only

    def run(fn):
        y = logits.clone().requires_grad_(True)
        out = fn(y)
        return out, y

    for chunk in (8, None):
        (lp, ent), y = run(lambda y: gather_logprobs_entropy(y, labels, temperature, chunk_size=chunk))
        grad = torch.autograd.grad((a * lp).sum() + (c * ent).sum(), y)[0]
        assert torch.isfinite(grad).all() and (grad[::4, 17:] == 0).all()
        torch.testing.assert_close(lp.double(), want_lp.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(ent.double(), want_ent.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(grad.double(), want, atol=1e-5, rtol=0)

        lp, y = run(lambda y: gather_logprobs(y, labels, temperature, chunk_size=chunk))
        grad = torch.autograd.grad((a * lp).sum(), y)[0]
        torch.testing.assert_close(lp.double(), want_lp.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(grad.double(), want_lp_only, atol=1e-5, rtol=0)

        ent, y = run(lambda y: token_entropy(y, temperature, chunk_size=chunk))
        grad = torch.autograd.grad((c * ent).sum(), y)[0]
        torch.testing.assert_close(ent.double(), want_ent.detach(), atol=1e-5, rtol=0)
        torch.testing.assert_close(grad.double(), want_ent_only, atol=1e-5, rtol=0)

    (lp, ent), y = run(lambda y: gather_logprobs_entropy_stat(y, labels, temperature, chunk_size=8))
    assert not ent.requires_grad
    torch.testing.assert_close(ent.double(), want_ent.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.autograd.grad((a * lp).sum(), y)[0].double(), want_lp_only, atol=1e-5, rtol=0)
