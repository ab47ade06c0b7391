"""EngineOffload: a train engine's parameters, gradients and optimizer state leave their
storages for host memory and come back bit for bit (CPU, FSDP2 on a world of one)."""

from __future__ import annotations

import torch

from arealite.config.schema import ActorConfig
from arealite.train_engine.fsdp import FSDPEngine
from arealite.train_engine.offload import EngineOffload
from tests.test_fsdp import LENGTHS, make_batch, n_tokens, token_mean_ce


def _weights(engine):
    return {n: t.clone() for b in engine.named_weight_buckets(1 << 20) for n, t in b}


def test_offload_frees_the_storages_and_onload_trains_bit_for_bit(micro_model_dir):
    cfg = ActorConfig(model_path=str(micro_model_dir), mb_max_tokens=24)
    cfg.optimizer.lr = 1e-2
    plain, parked = (FSDPEngine(cfg, device="cpu").initialize() for _ in range(2))
    try:
        batch = make_batch(plain.hf_config.vocab_size, LENGTHS)
        for e in (plain, parked):
            e.train_batch(batch, token_mean_ce, n_tokens)  # AdamW's moments and the gradients exist now
        offload = EngineOffload(parked)
        held = offload.device_bytes()
        n_params = sum(p.numel() * p.element_size() for p in parked.model.parameters())
        assert held >= 3 * n_params  # parameters + gradients + two moments
        offload_s = offload.offload()
        assert offload.device_bytes() == 0 and offload_s >= 0
        assert all(p.to_local().untyped_storage().nbytes() == 0 for p in parked.model.parameters())
        assert offload.offload() == 0.0  # already in host memory: nothing to do
        offload.onload()
        assert offload.device_bytes() == held
        losses = [e.train_batch(batch, token_mean_ce, n_tokens)["loss"] for e in (plain, parked)]
        assert losses[0] == losses[1]
        a, b = _weights(plain), _weights(parked)
        assert all(torch.equal(a[n], b[n]) for n in a)
    finally:
        parked.destroy()
        plain.destroy()
