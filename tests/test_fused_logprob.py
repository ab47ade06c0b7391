"""The fused chunked output head (issue 30, item 2): the same numbers as the materialised logits.

- `fused_logprobs_entropy` on ``(hidden, weight, bias)`` against ``log_softmax(linear(...) / T)``:
  log-probs, entropies and the gradients of hidden states, weight and bias within 1e-5 (fp32),
  temperatures 1 and 0.7, chunk sizes that do not divide T, and no ``[T, V]`` tensor saved;
- the logits form (``ChunkedHead.from_logits``, the kernel that ``arealite.algo.logprob`` wraps)
  against the plain log-softmax, masked (``-inf``) logits included;
- row counts one under, at and one over a multiple of the chunk size, in both forms;
- the engine's training step: the PPO loss through the fused head gives the loss, stats and
  gradients of the same loss on materialised logits (the path before issue 30), with tied
  embeddings, and with a LoRA adapter wrapping ``lm_head``; ``forward`` log-probs likewise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from arealite.algo.logprob import gather_logprobs_entropy
from arealite.ops.fused_logprob import chunk_rows, fused_logprobs_entropy
from arealite.train_engine.lm_head import ChunkedHead, head_params
from tests.test_algo_logprob import plain_logprobs_entropy

TOL = 1e-5


def _inputs(T=37, H=16, V=50, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) * 0.5).requires_grad_(True)
    b = (torch.randn(V, generator=g) * 0.1).requires_grad_(True) if bias else None
    labels = torch.randint(0, V, (T,), generator=g)
    # Upstream gradients of log-prob and entropy, as a loss would send them.
    a, c = torch.randn(T, generator=g), torch.randn(T, generator=g)
    return h, w, b, labels, a, c


def _reference(h, w, b, labels, temperature):
    logp_all = torch.log_softmax(F.linear(h, w, b).float() / temperature, -1)
    logp = logp_all.gather(-1, labels[:, None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def _grads(tensors, out):
    return torch.autograd.grad(out, [t for t in tensors if t is not None])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [5, 16, 37, 64, None])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_equals_materialised_logits_values_and_gradients(temperature, chunk, bias):
    h, w, b, labels, a, c = _inputs(bias=bias)
    want_lp, want_ent = _reference(h, w, b, labels, temperature)
    got_lp, got_ent = fused_logprobs_entropy(h, w, labels, temperature, bias=b, chunk_size=chunk)
    assert got_lp.dtype == got_ent.dtype == torch.float32
    assert (got_lp - want_lp).abs().max() <= TOL and (got_ent - want_ent).abs().max() <= TOL
    want = _grads((h, w, b), (a * want_lp).sum() + (c * want_ent).sum())
    got = _grads((h, w, b), (a * got_lp).sum() + (c * got_ent).sum())
    for x, y in zip(got, want):
        assert (x - y).abs().max() <= TOL
    # Only the log-prob carries a gradient (the entropy a stat): the cheaper backward.
    want = _grads((h, w, b), (a * _reference(h, w, b, labels, temperature)[0]).sum())
    got = _grads((h, w, b), (a * fused_logprobs_entropy(h, w, labels, temperature, bias=b, chunk_size=chunk,
                                                         with_entropy=False)[0]).sum())
    for x, y in zip(got, want):
        assert (x - y).abs().max() <= TOL


def test_only_the_entropy_with_a_gradient():
    h, w, b, labels, _, c = _inputs(seed=1)
    want = _grads((h, w, b), (c * _reference(h, w, b, labels, 0.9)[1]).sum())
    got = _grads((h, w, b), (c * fused_logprobs_entropy(h, w, labels, 0.9, bias=b, chunk_size=7)[1]).sum())
    for x, y in zip(got, want):
        assert (x - y).abs().max() <= TOL


def test_bfloat16_head_scores_as_the_materialised_bfloat16_logits():
    # The model's head in low precision (FSDP's bf16 compute): the chunk's logits are the same
    # bf16 matmul cast to float32, so the log-probs match; gradients come back in bf16.
    h, w, _, labels, a, c = _inputs(T=21, H=32, V=64, bias=False, seed=3)
    hb, wb = (t.detach().bfloat16().requires_grad_(True) for t in (h, w))
    want_lp, want_ent = _reference(hb, wb, None, labels, 0.8)
    got_lp, got_ent = fused_logprobs_entropy(hb, wb, labels, 0.8, chunk_size=8)
    assert (got_lp - want_lp).abs().max() <= TOL and (got_ent - want_ent).abs().max() <= TOL
    want = _grads((hb, wb), (a * want_lp).sum() + (c * want_ent).sum())
    got = _grads((hb, wb), (a * got_lp).sum() + (c * got_ent).sum())
    for x, y in zip(got, want):
        assert x.dtype == torch.bfloat16 and (x.float() - y.float()).abs().max() <= 0.02 * y.float().abs().max()


def test_nothing_of_size_t_by_v_is_kept_for_the_backward():
    T, H, V = 64, 8, 300
    h, w, b, labels, a, _ = _inputs(T=T, H=H, V=V)
    saved: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        logp, ent = fused_logprobs_entropy(h, w, labels, bias=b, chunk_size=16)
    assert saved and max(s[0] * s[-1] if len(s) == 2 else 0 for s in saved) <= V * H
    (a * logp).sum().backward()
    assert h.grad.shape == (T, H) and w.grad.shape == (V, H)
    assert chunk_rows(151_936) * 151_936 * 4 <= 256 << 20  # the default chunk: ~256 MiB of logits


def test_logits_form_equals_the_plain_formula_and_survives_masked_logits():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(11, 9, generator=g)
    logits[:, 6:] = -float("inf")  # a masked vocabulary
    logits.requires_grad_(True)
    labels = torch.randint(0, 6, (11,), generator=g)
    want_lp, want_ent = plain_logprobs_entropy(logits, labels, 0.8)
    want = torch.autograd.grad(want_lp.sum() + 0.3 * want_ent.sum(), logits)[0]
    head = ChunkedHead.from_logits(logits, chunk_size=4)
    got_lp, got_ent = head.logprobs_entropy(labels, 0.8)
    got = torch.autograd.grad(got_lp.sum() + 0.3 * got_ent.sum(), logits)[0]
    assert torch.isfinite(got).all() and (got[:, 6:] == 0).all()
    assert (got_lp - want_lp).abs().max() <= TOL and (got_ent - want_ent).abs().max() <= TOL
    assert (got - want).abs().max() <= TOL
    assert torch.equal(head.logits(), logits)


@pytest.mark.parametrize("rows", [15, 16, 17])  # one under, at and one over a multiple of the chunk (8)
def test_both_forms_at_a_chunk_edge(rows):
    h, w, b, labels, a, c = _inputs(T=rows, seed=rows)
    want_lp, want_ent = _reference(h, w, b, labels, 0.7)
    want = _grads((h, w, b), (a * want_lp).sum() + (c * want_ent).sum())
    got_lp, got_ent = ChunkedHead(h, w, b, chunk_size=8).logprobs_entropy(labels, 0.7)
    assert (got_lp - want_lp).abs().max() <= TOL and (got_ent - want_ent).abs().max() <= TOL
    for x, y in zip(_grads((h, w, b), (a * got_lp).sum() + (c * got_ent).sum()), want):
        assert (x - y).abs().max() <= TOL
    logits = F.linear(h, w, b).detach()
    logits[::3, 40:] = logits[-1, 40:] = -float("inf")  # masked rows, the last (partial) chunk's included
    labels = labels % 40
    logits.requires_grad_(True)
    want_lp, want_ent = plain_logprobs_entropy(logits, labels, 0.7)
    want = torch.autograd.grad((a * want_lp).sum() + (c * want_ent).sum(), logits)[0]
    got_lp, got_ent = ChunkedHead.from_logits(logits, chunk_size=8).logprobs_entropy(labels, 0.7)
    got = torch.autograd.grad((a * got_lp).sum() + (c * got_ent).sum(), logits)[0]
    assert (got_lp - want_lp).abs().max() <= TOL and (got_ent - want_ent).abs().max() <= TOL
    assert torch.isfinite(got).all() and (got[::3, 40:] == 0).all() and (got - want).abs().max() <= TOL


def test_head_forms_agree_and_errors_are_clear():
    h, w, b, labels, _, _ = _inputs(T=6, V=20)
    fused = ChunkedHead(h, w, b, chunk_size=4)
    assert fused.fused and not ChunkedHead.from_logits(fused.logits()).fused
    assert (fused.logprobs(labels, 0.5) - ChunkedHead.from_logits(fused.logits()).logprobs(labels, 0.5)).abs().max() \
        <= TOL
    assert fused.logits().shape == (6, 20) and fused.logits().dtype == torch.float32
    with pytest.raises(ValueError, match="temperature"):
        fused.logprobs(labels, 0.0)
    with pytest.raises(ValueError, match="labels of shape"):
        fused.logprobs(labels[:-1])
    with pytest.raises(TypeError, match="integer"):
        fused.logprobs(labels.float())
    with pytest.raises(ValueError, match="chunk_size"):
        fused_logprobs_entropy(h, w, labels, chunk_size=0)


def test_head_params_of_a_lora_head_fold_the_adapter():
    peft = pytest.importorskip("peft")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(8, 30, bias=False)

        def forward(self, x):
            return self.lm_head(x)

    torch.manual_seed(0)
    net = peft.get_peft_model(Net(), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["lm_head"]))
    head = net.base_model.model.lm_head
    torch.nn.init.normal_(head.lora_B["default"].weight)  # B = 0 at init: make the adapter count
    x = torch.randn(5, 8)
    w, b = head_params(head)
    assert b is None and (F.linear(x, w) - head(x)).abs().max() <= TOL
    with net.disable_adapter():
        w_off, _ = head_params(head)
        assert torch.equal(w_off, head.base_layer.weight)
    head.lora_dropout["default"] = torch.nn.Dropout(0.5)
    assert head_params(head) is None  # dropout in training: not one linear map, materialised
    assert head_params(torch.nn.Sequential(torch.nn.Linear(8, 3))) is None


# ---------------------------------------------------------------- through the engine


def _ppo_batch(vocab: int):
    from tests.test_fsdp import LENGTHS, make_batch

    batch = make_batch(vocab, LENGTHS, seed=4)
    g = torch.Generator().manual_seed(5)
    mask = batch["loss_mask"]
    batch["logprobs"] = -torch.rand(mask.shape, generator=g) * 3 * mask
    batch["advantages"] = torch.randn(mask.shape[0], generator=g)[:, None] * mask
    return batch


def _materialised(loss_fn):
    """``loss_fn`` on the logits materialised in float32 first: the engine's path before issue 30."""
    return lambda head, mb: loss_fn(ChunkedHead.from_logits(head.logits()), mb)


def _grads_of(engine):
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in engine.model.named_parameters() if p.grad is not None}


def _engine(model_dir, lora=None):
    from arealite.config.schema import ActorConfig, LoraConfig

    cfg = ActorConfig(model_path=str(model_dir), mb_max_tokens=24,
                      lora=None if lora is None else LoraConfig(rank=2, alpha=4.0, target_modules=lora))
    cfg.optimizer.lr, cfg.optimizer.gradient_clipping = 1e-3, 0.0
    if lora is None:
        from arealite.train_engine.fsdp import FSDPEngine

        return FSDPEngine(cfg, device="cpu").initialize()
    from arealite.lora import LoraFSDPEngine

    return LoraFSDPEngine(cfg, device="cpu").initialize()


def _same_step(make, batch, loss_fn):
    """Train one step with the fused loss and one (on a fresh engine) with the materialised one."""
    out, kinds = [], []

    def fused(head, mb):
        kinds.append(head.fused)
        return loss_fn(head, mb)

    for fn in (fused, _materialised(loss_fn)):
        engine = make()
        try:
            stats = engine.train_batch(batch, fn, lambda mb: float(mb["loss_mask"].sum()))
            out.append((stats, _grads_of(engine)))
        finally:
            engine.destroy()
    (s_fused, g_fused), (s_old, g_old) = out
    assert kinds and all(kinds)  # the engine handed the loss the hidden states, not logits
    assert abs(s_fused["loss"] - s_old["loss"]) <= TOL and abs(s_fused["grad_norm"] - s_old["grad_norm"]) <= TOL
    assert abs(s_fused["entropy"] - s_old["entropy"]) <= TOL
    assert g_fused.keys() == g_old.keys() and g_fused
    for n in g_old:
        assert (g_fused[n] - g_old[n]).abs().max() <= TOL, n
    return g_fused


def test_engine_step_with_the_fused_head_equals_the_materialised_logits(micro_model_dir):
    from arealite.algo.actor import PPOActor
    from arealite.config.schema import AlgorithmConfig

    probe = _engine(micro_model_dir)
    assert probe.hf_config.tie_word_embeddings  # the head's weight is the (root-gathered) embedding
    batch = _ppo_batch(probe.hf_config.vocab_size)
    actor = PPOActor(AlgorithmConfig(entropy_coef=0.01, n_minibatches=1), probe, temperature=0.7)
    # Log-probs without a graph at the sampling temperature: fused equals materialised.
    fused = actor.compute_logp(batch)
    old = probe.forward(batch, lambda head, mb: gather_logprobs_entropy(head.logits(), mb["labels"], 0.7)[0])
    assert (fused - old).abs().max() <= TOL
    probe.destroy()
    grads = _same_step(lambda: _engine(micro_model_dir), batch, actor.loss_fn())
    assert any("embed_tokens" in n for n in grads)  # the tied head's gradient reached the embedding


def test_lora_engine_with_an_adapter_on_lm_head(micro_model_dir):
    pytest.importorskip("peft")
    from arealite.algo.sft import sft_loss_fn

    batch = _ppo_batch(_vocab(micro_model_dir))
    grads = _same_step(lambda: _engine(micro_model_dir, lora=["q_proj", "lm_head"]), batch, _with_entropy(sft_loss_fn))
    assert any("lm_head.lora_A" in n for n in grads) and any("lm_head.lora_B" in n for n in grads)


def _with_entropy(loss_fn):
    def fn(head, mb):
        _, ent = head.logprobs_entropy(mb["labels"], 1.0)
        mb["_stats"] = {"entropy": float(ent.detach().mean())}
        return loss_fn(head, mb) - 0.01 * ent.mean()
    return fn


def _vocab(model_dir) -> int:
    import json

    return json.loads((model_dir / "config.json").read_text())["vocab_size"]
