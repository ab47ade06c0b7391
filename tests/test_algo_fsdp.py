"""PPOActor on the real FSDPEngine, in this process (gloo, a world of one)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from arealite.algo import PPOActor
from arealite.config.schema import ActorConfig, AlgorithmConfig, OptimizerConfig

from tests.test_algo_actor import make_batch, seq_logp

fsdp = pytest.importorskip("arealite.train_engine.fsdp")


@pytest.fixture()
def engines(micro_model_dir):
    cfg = ActorConfig(model_path=str(micro_model_dir), mb_max_tokens=24,
                      optimizer=OptimizerConfig(lr=2e-3, weight_decay=0.0))
    # On the CPU even on a GPU machine: the checks compare with a CPU forward.
    actor_engine = fsdp.FSDPEngine(cfg, device="cpu").initialize(total_steps=10)
    ref_engine = fsdp.FSDPEngine(cfg, frozen=True, device="cpu").initialize()
    yield actor_engine, ref_engine
    ref_engine.destroy()
    actor_engine.destroy()  # created the process group: destroys it last


def test_ppo_actor_on_fsdp_engine(micro_model_dir, engines):
    actor_engine, ref_engine = engines
    vocab = AutoTokenizer.from_pretrained(micro_model_dir).vocab_size
    cfg = AlgorithmConfig(adv_estimator="grpo", kl_coef=0.05, kl_estimator="k3", use_decoupled_loss=True)
    actor = PPOActor(cfg, actor_engine, temperature=0.8, ref_engine=ref_engine)
    batch = make_batch(vocab, seed=1)
    mask = batch["loss_mask"]

    # compute_logp through FSDP packing equals a plain padded HF forward.
    prox = actor.compute_logp(batch)
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(micro_model_dir, dtype=torch.float32)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long()).logits
    want = torch.log_softmax(logits[:, :-1].double() / 0.8, -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    am = batch["attention_mask"]
    assert (prox[:, 0] == 0).all() and (prox[~am] == 0).all()
    diff = (prox[:, 1:].double() - want).abs()[am[:, 1:]]
    assert float(diff.max()) <= 1e-5

    batch["logprobs"] = torch.where(mask, prox, torch.zeros(()))
    batch["prox_logp"] = prox
    batch["rewards"] = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    actor.compute_advantages(batch)
    seq_adv = batch["advantages"].sum(1) / mask.sum(1)
    stats = actor.ppo_update(batch)
    assert actor_engine.step_count == 1
    s = stats[0]
    assert s["n_mbs"] > 1 and s["skipped"] == 0
    assert s["kl_ref"] < 1e-6 and math.isfinite(s["grad_norm"]) and s["grad_norm"] > 0
    assert abs(s["imp_weight_mean"] - 1.0) < 1e-6 and s["logp_mismatch_max"] < 1e-6

    delta = seq_logp(actor.compute_logp(batch), mask) - seq_logp(prox, mask)
    assert (delta[seq_adv > 0] > 0).all(), delta
    assert (delta[seq_adv < 0] < 0).all(), delta
    # The frozen reference did not move.
    torch.testing.assert_close(actor.compute_logp(batch, engine=ref_engine), prox)
