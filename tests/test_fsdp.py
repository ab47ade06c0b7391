"""FSDPEngine in one process (a world of one it creates itself), against plain HF PyTorch.

Every engine here runs on the CPU (``device="cpu"``, gloo), GPU or not, so the
comparisons with CPU references are exact; the CUDA path has its own ``gpu`` test.
Multi-process equality, sharded resume and export under torchrun: test_fsdp_dist.py.
"""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file

from arealite.config.schema import ActorConfig
from arealite.train_engine.fsdp import FSDPEngine, compute_dtype
from arealite.train_engine.lr_schedule import lr_factor


def make_batch(vocab: int, lengths: list[int], prompt_len: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.randint(5, vocab, (len(lengths), L), generator=g)
    am = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    return {
        "input_ids": ids * am,
        "attention_mask": am,
        "loss_mask": am & (torch.arange(L)[None, :] >= prompt_len),
        "rewards": torch.arange(len(lengths), dtype=torch.float32),
    }


def label_logp(head, mb):
    """The fused path: the log-prob of each label from the hidden states, no [T, V] logits."""
    return head.logprobs(mb["labels"])


def token_mean_ce(head, mb):
    mask = mb["loss_mask"].float()
    return -(label_logp(head, mb) * mask).sum() / mask.sum().clamp(min=1)


def n_tokens(mb):
    return mb["loss_mask"].sum()


def seq_mean_ce(head, mb):
    """Mean over sequences of each sequence's token-mean CE: weighted by sequences. Materialises
    the logits (``head.logits()``): the other path of the contract."""
    mask = mb["loss_mask"].float()
    tok = torch.log_softmax(head.logits(), dim=-1).gather(-1, mb["labels"][:, None])[:, 0] * -mask
    cu = mb["cu_seqlens"].tolist()
    per_seq = [tok[a:b].sum() / mask[a:b].sum().clamp(min=1) for a, b in zip(cu[:-1], cu[1:])]
    return torch.stack(per_seq).mean()


def hf_padded(model_dir, batch):
    """Plain HF forward/backward on the padded batch: the reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    return model, logp, batch["loss_mask"][:, 1:].float()


def full_grads(engine):
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in engine.model.named_parameters()}


@pytest.fixture
def make_engine(micro_model_dir):
    engines = []

    def _make(frozen=False, **opt):
        cfg = ActorConfig(model_path=str(micro_model_dir), mb_max_tokens=opt.pop("mb_max_tokens", 24))
        for k, v in opt.items():
            setattr(cfg.optimizer, k, v)
        e = FSDPEngine(cfg, frozen=frozen, device="cpu").initialize()
        engines.append(e)
        return e

    yield _make
    for e in reversed(engines):
        e.destroy()


LENGTHS = [20, 7, 13, 3, 18, 9]


def test_packed_microbatches_equal_padded_loss_and_gradients(make_engine, micro_model_dir):
    engine = make_engine(gradient_clipping=0.0, lr=1e-3)
    batch = make_batch(engine.hf_config.vocab_size, LENGTHS)
    # Gradients stay on the parameters until the next step: read them after the token-mean step.
    stats = engine.train_batch(batch, token_mean_ce, n_tokens)
    assert stats["n_mbs"] >= 3  # the budget of 24 tokens forces several packed micro-batches
    assert stats["n_tokens_computed"] == stats["n_tokens"]  # packing computes no padding
    grads = full_grads(engine)

    ref, logp, mask = hf_padded(micro_model_dir, batch)
    loss = -(logp * mask).sum() / mask.sum()
    loss.backward()
    assert abs(stats["loss"] - loss.item()) <= 1e-5
    assert stats["n_tokens"] == sum(LENGTHS) and stats["skipped"] == 0
    ref_grads = dict(ref.named_parameters())
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert (g - ref_grads[name].grad).abs().max().item() <= 1e-5, name
    assert math.isclose(
        stats["grad_norm"], torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()])).item(),
        rel_tol=1e-5,
    )


def test_sequence_weighted_loss_is_the_global_sequence_mean(make_engine, micro_model_dir):
    # Other units than tokens: weight = sequences, loss = mean over sequences.
    engine = make_engine(gradient_clipping=0.0)
    batch = make_batch(engine.hf_config.vocab_size, LENGTHS, seed=1)
    stats = engine.train_batch(batch, seq_mean_ce, lambda mb: len(mb["cu_seqlens"]) - 1)
    grads = full_grads(engine)
    ref, logp, mask = hf_padded(micro_model_dir, batch)
    loss = (-(logp * mask).sum(1) / mask.sum(1)).mean()
    loss.backward()
    assert abs(stats["loss"] - loss.item()) <= 1e-5
    for name, p in ref.named_parameters():
        assert (grads[name] - p.grad).abs().max().item() <= 1e-5, name


def test_forward_logprobs_equal_plain_hf(make_engine, micro_model_dir):
    engine = make_engine()
    batch = make_batch(engine.hf_config.vocab_size, LENGTHS, seed=2)
    out = engine.forward(batch, label_logp)
    assert out.shape == batch["input_ids"].shape and out.dtype == torch.float32
    _, logp, _ = hf_padded(micro_model_dir, batch)
    am = batch["attention_mask"]
    # out[b, j] scores input_ids[b, j]: position 0 and padding are 0.
    assert (out[:, 0] == 0).all() and (out[~am] == 0).all()
    real = am[:, 1:]
    assert (out[:, 1:][real] - logp.detach()[real]).abs().max().item() <= 1e-5


def test_lr_schedule_values():
    assert [lr_factor(s, "constant", 2) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    lin = [lr_factor(s, "linear", 1, total_steps=5, min_lr_ratio=0.2) for s in range(7)]
    assert lin == pytest.approx([1.0, 1.0, 0.2 + 0.8 * 2 / 3, 0.2 + 0.8 / 3, 0.2, 0.2, 0.2])
    cos = [lr_factor(s, "cosine", 0, total_steps=5) for s in range(5)]
    assert cos == pytest.approx([1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.0])
    with pytest.raises(ValueError, match="total_steps"):
        lr_factor(3, "cosine", 0, None)


def test_engine_follows_warmup_then_linear_decay(make_engine):
    engine = make_engine(lr=1e-3, warmup_steps=2, lr_scheduler="linear", total_steps=4, min_lr_ratio=0.1)
    batch = make_batch(engine.hf_config.vocab_size, [6, 5])
    lrs = [engine.train_batch(batch, token_mean_ce, n_tokens)["lr"] for _ in range(5)]
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 1e-4, 1e-4])
    assert engine.step_count == 5


def test_nonfinite_gradient_skips_the_step(make_engine):
    engine = make_engine(lr=1e-2)
    batch = make_batch(engine.hf_config.vocab_size, [8, 6])
    before = {n: t.clone() for b in engine.named_weight_buckets(1 << 20) for n, t in b}
    stats = engine.train_batch(batch, lambda lg, mb: token_mean_ce(lg, mb) * float("nan"), n_tokens)
    assert stats["skipped"] == 1.0 and not math.isfinite(stats["grad_norm"])
    after = {n: t for b in engine.named_weight_buckets(1 << 20) for n, t in b}
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert engine.step_count == 0 and all(p.grad is None for p in engine.model.parameters())
    # The next finite step trains normally.
    assert engine.train_batch(batch, token_mean_ce, n_tokens)["skipped"] == 0.0
    assert engine.step_count == 1


def test_frozen_engine_is_a_reference_model(make_engine):
    ref = make_engine(frozen=True)
    assert ref.optimizer is None and ref.lr_scheduler is None
    assert not any(p.requires_grad for p in ref.model.parameters())
    batch = make_batch(ref.hf_config.vocab_size, LENGTHS)
    out = ref.forward(batch, label_logp)
    assert out[batch["attention_mask"]][1:].abs().sum() > 0
    with pytest.raises(RuntimeError, match="frozen"):
        ref.train_batch(batch, token_mean_ce, n_tokens)


def test_named_weight_buckets_are_the_hf_state_dict(make_engine, micro_model_dir):
    engine = make_engine()
    on_disk = load_file(str(micro_model_dir / "model.safetensors"))
    bucket_bytes = 40_000
    buckets = list(engine.named_weight_buckets(bucket_bytes))
    assert len(buckets) > 1
    for b in buckets:
        size = sum(t.numel() * t.element_size() for _, t in b)
        assert size <= bucket_bytes or len(b) == 1
    got = {n: t for b in buckets for n, t in b}
    # Tied lm_head is absent, exactly as in the file save_pretrained wrote.
    assert sorted(got) == sorted(on_disk)
    for n, t in got.items():
        assert torch.equal(t, on_disk[n]), n
    with pytest.raises(ValueError, match="bucket_bytes"):
        next(engine.named_weight_buckets(0))


def test_export_hf_after_training_loads_and_matches(make_engine, tmp_path):
    from transformers import AutoModelForCausalLM

    engine = make_engine(lr=1e-2)
    batch = make_batch(engine.hf_config.vocab_size, LENGTHS)
    engine.train_batch(batch, token_mean_ce, n_tokens)
    engine.export_hf(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, attn_implementation="sdpa")
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # still tied
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    out = engine.forward(batch, label_logp)
    real = batch["attention_mask"][:, 1:]
    assert (out[:, 1:][real] - logp.detach()[real]).abs().max().item() <= 1e-5
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def test_save_load_continue_equals_uninterrupted(micro_model_dir, tmp_path):
    def engine():
        cfg = ActorConfig(model_path=str(micro_model_dir), mb_max_tokens=24)
        cfg.optimizer.lr, cfg.optimizer.lr_scheduler, cfg.optimizer.total_steps = 1e-2, "cosine", 5
        return FSDPEngine(cfg, device="cpu").initialize()

    a = engine()
    batch = make_batch(a.hf_config.vocab_size, LENGTHS)
    for _ in range(2):
        a.train_batch(batch, token_mean_ce, n_tokens)
    a.set_version(2)
    a.save(tmp_path / "ckpt")
    rng_at_save = torch.get_rng_state(), random.getstate()
    losses_a = [a.train_batch(batch, token_mean_ce, n_tokens)["loss"] for _ in range(2)]
    weights_a = {n: t.clone() for b in a.named_weight_buckets(1 << 20) for n, t in b}
    lr_a = a.optimizer.param_groups[0]["lr"]
    a.destroy()

    b = engine()
    torch.manual_seed(123)
    random.seed(123)
    b.load(tmp_path / "ckpt")
    assert torch.equal(torch.get_rng_state(), rng_at_save[0]) and random.getstate() == rng_at_save[1]
    assert b.get_version() == 2 and b.step_count == 2
    losses_b = [b.train_batch(batch, token_mean_ce, n_tokens)["loss"] for _ in range(2)]
    weights_b = {n: t for bk in b.named_weight_buckets(1 << 20) for n, t in bk}
    assert losses_b == losses_a
    assert all(torch.equal(weights_a[n], weights_b[n]) for n in weights_a)
    assert b.optimizer.param_groups[0]["lr"] == lr_a < 1e-2
    b.destroy()


def test_bad_inputs_fail_with_clear_errors(make_engine, tmp_path):
    engine = make_engine()
    batch = make_batch(engine.hf_config.vocab_size, [5, 4])
    left = {**batch, "attention_mask": batch["attention_mask"].flip(1)}
    with pytest.raises(ValueError, match="right-padded"):
        engine.train_batch(left, token_mean_ce, n_tokens)
    with pytest.raises(KeyError, match="attention_mask"):
        engine.forward({"input_ids": batch["input_ids"]}, label_logp)
    with pytest.raises(TypeError, match="0-dim"):
        engine.train_batch(batch, lambda lg, mb: label_logp(lg, mb), n_tokens)
    with pytest.raises(ValueError, match="loss_weight_fn"):
        engine.train_batch(batch, token_mean_ce, lambda mb: -1.0)
    with pytest.raises(FileNotFoundError, match="checkpoint"):
        engine.load(tmp_path / "nothing")
    with pytest.raises(ValueError, match="model_path"):
        FSDPEngine(ActorConfig())
    with pytest.raises(ValueError, match="device='gpu'"):
        FSDPEngine(engine.config, device="gpu")


def test_gradient_checkpointing_and_bf16_options(micro_model_dir):
    """Activation checkpointing changes no gradient; bf16 compute keeps fp32 master weights and trains."""
    from tensordict import TensorDict

    def grads_with(**opts):
        cfg = ActorConfig(model_path=str(micro_model_dir), mb_max_tokens=24, **opts)
        cfg.optimizer.gradient_clipping = 0.0
        cfg.optimizer.lr = 1e-2
        e = FSDPEngine(cfg, device="cpu").initialize()
        try:
            batch = TensorDict(make_batch(e.hf_config.vocab_size, LENGTHS), batch_size=[len(LENGTHS)])
            losses = [e.train_batch(batch, token_mean_ce, n_tokens)["loss"]]
            g = full_grads(e)
            losses += [e.train_batch(batch, token_mean_ce, n_tokens)["loss"] for _ in range(2)]
            dtypes = {p.dtype for p in e.model.parameters()}
            assert e.model.is_activation_checkpointing == opts.get("gradient_checkpointing", False)
            return losses, g, (e.dtype, dtypes)
        finally:
            e.destroy()

    plain_losses, plain_grads, (plain_dtype, _) = grads_with()
    assert plain_dtype == torch.float32  # dtype `auto` on the CPU
    ckpt_losses, ckpt_grads, _ = grads_with(gradient_checkpointing=True)
    assert ckpt_losses == pytest.approx(plain_losses, abs=1e-6)
    for n, g in plain_grads.items():
        assert (ckpt_grads[n] - g).abs().max().item() <= 1e-6, n
    bf16_losses, _, dtypes = grads_with(dtype="bfloat16")
    assert dtypes == (torch.bfloat16, {torch.float32})
    assert bf16_losses[0] == pytest.approx(plain_losses[0], abs=5e-2)  # bf16 rounding only
    assert bf16_losses[-1] < bf16_losses[0]


def test_auto_dtype_is_bf16_on_cuda_and_fp32_on_cpu():
    assert compute_dtype("auto", "cuda") == torch.bfloat16
    assert compute_dtype("auto", "cpu") == torch.float32
    assert compute_dtype("bfloat16", "cpu") == torch.bfloat16
    assert compute_dtype("float32", "cuda") == torch.float32


def test_dropout_is_off_in_forward_and_training(micro_model_dir, tmp_path):
    """A model configured with dropout scores deterministically, and the training forward
    (where the PPO loss takes its proximal log-probs) scores exactly as forward() does."""
    model_dir = tmp_path / "with_dropout"
    shutil.copytree(micro_model_dir, model_dir)
    hf_config = json.loads((model_dir / "config.json").read_text())
    hf_config["attention_dropout"] = 0.5
    (model_dir / "config.json").write_text(json.dumps(hf_config))
    engine = FSDPEngine(ActorConfig(model_path=str(model_dir), mb_max_tokens=24), device="cpu").initialize()
    try:
        batch = make_batch(engine.hf_config.vocab_size, LENGTHS, seed=3)
        logp = engine.forward(batch, label_logp)
        assert torch.equal(engine.forward(batch, label_logp), logp)
        assert engine.model.training  # forward restored the mode
        stats = engine.train_batch(batch, token_mean_ce, n_tokens)
        assert abs(stats["loss"] + logp[batch["loss_mask"]].mean().item()) <= 1e-5
        assert engine.hf_config.attention_dropout == 0.5  # the config export_hf writes is the user's
    finally:
        engine.destroy()


@pytest.mark.gpu
def test_cuda_bf16_training_and_forward(micro_model_dir):
    """CUDA path: NCCL group, bf16 compute (dtype `auto`) with fp32 reduction and fp32 master weights."""
    cfg = ActorConfig(model_path=str(micro_model_dir), mb_max_tokens=24)
    cfg.optimizer.lr = 1e-2
    engine = FSDPEngine(cfg).initialize()
    try:
        assert engine.device.type == "cuda" and engine.dtype == torch.bfloat16
        batch = make_batch(engine.hf_config.vocab_size, LENGTHS)
        losses = [engine.train_batch(batch, token_mean_ce, n_tokens)["loss"] for _ in range(4)]
        assert losses[-1] < losses[0]
        assert all(p.dtype == torch.float32 for p in engine.model.parameters())
        out = engine.forward(batch, label_logp)
        assert out.shape == batch["input_ids"].shape and torch.isfinite(out).all()
    finally:
        engine.destroy()
