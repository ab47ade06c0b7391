"""The LoRA weight push end to end: a LoRA engine, the real client and controller, a real
embedded server. Only the adapter travels; a generation interrupted by the push resumes on
the new adapter, and every token's log-prob is that of the adapter that produced it."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest
import torch

from arealite.api.types import GenerationRequest, SamplingParams
from arealite.config.schema import ArealiteConfig, RolloutConfig
from arealite.inference_client.sglang_client import SGLangClient
from arealite.lora import LoraFSDPEngine
from arealite.server.process import ServerProcess
from arealite.weight_sync import LoraTransfer, make_publisher
from tests.conftest import RolloutOf, free_port
from tests.test_fsdp import LENGTHS, label_logp, make_batch, n_tokens, token_mean_ce

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture
def server(micro_model_dir, tmp_path):
    proc = ServerProcess(micro_model_dir, free_port(), log_path=tmp_path / "server.log", threads=1)
    try:
        yield proc.wait_healthy()
    finally:
        proc.stop()


@pytest.fixture
def rollout(server):
    """A generating client and its controller, and a second client that administers the
    servers for the publisher, as in a run whose rollout side is a worker process: nothing
    tells the generating client about a push but the config (``actor.lora.served_name``)."""
    from arealite.rollout.controller import RolloutController

    rc = RolloutConfig(request_timeout_s=60, request_retries=0)
    client = SGLangClient([server.url], rc, lora_adapter="policy")
    controller = RolloutController(client, RolloutConfig()).start(init_timeout=90)
    admin_client = SGLangClient([server.url], rc, lora_adapter="policy")
    controller.run(admin_client.initialize(60))
    yield client, controller, admin_client
    controller.run(admin_client.aclose())
    controller.stop()



def config(tmp_path, model_dir) -> ArealiteConfig:
    return ArealiteConfig.model_validate({
        "experiment": {"output_root": str(tmp_path), "name": "e", "trial": "t"},
        "actor": {"model_path": str(model_dir), "mb_max_tokens": 512, "optimizer": {"lr": 3e-2},
                  "lora": {"rank": 4, "alpha": 8.0}},
        "weight_sync": {"method": "disk", "timeout_s": 30}})


def server_info(url: str) -> dict:
    with urllib.request.urlopen(url + "/get_server_info", timeout=5) as r:
        return json.loads(r.read())


def logp_of(engine_or_ref, ids: list[int], n_prompt: int) -> torch.Tensor:
    t = torch.tensor([ids])
    batch = {"input_ids": t, "attention_mask": torch.ones_like(t, dtype=torch.bool)}
    return engine_or_ref.forward(batch, label_logp)[0, n_prompt:]


def test_adapter_push_across_an_interrupted_generation(rollout, server, micro_model_dir, tmp_path):
    client, controller, admin_client = rollout
    cfg = config(tmp_path, micro_model_dir)
    engine = LoraFSDPEngine(cfg.actor, device="cpu").initialize(total_steps=4)
    pub = make_publisher(cfg, RolloutOf(admin_client, controller), engine)
    assert isinstance(pub.transfer, LoraTransfer)
    pub.init()
    root = tmp_path / "e" / "t" / "weight_sync" / "lora"
    try:
        t0 = pub.publish(0)  # the first push: the server holds no adapter yet
        dir0 = pub.transfer.current
        assert dir0.parent == root and dir0.name.startswith("policy-v0-") and dir0.is_dir()
        n_lora = sum(p.numel() for n, p in engine.model.named_parameters() if ".lora_" in n)
        assert t0["bytes"] == 4 * n_lora  # only the adapter, in fp32
        assert t0["probe_mean_abs_diff"] <= 1e-5

        batch = make_batch(engine.hf_config.vocab_size, LENGTHS)
        stats = engine.train_batch(batch, token_mean_ce, n_tokens)  # version 1, not yet pushed
        prompt, budget = list(range(10, 22)), 1000
        req = GenerationRequest(prompt, SamplingParams(max_new_tokens=budget, temperature=1.0, ignore_eos=True))
        before = server_info(server.url)["internal_states"][0]["generated_tokens"]
        fut = asyncio.run_coroutine_threadsafe(client.agenerate(req), controller._loop)
        deadline = time.monotonic() + 30
        while server_info(server.url)["internal_states"][0]["generated_tokens"] < before + 5:
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.005)
        assert not fut.done(), "generation finished before the push; raise the budget"
        t1 = pub.publish(1)
        c = fut.result(60)
        assert t1["probe_mean_abs_diff"] <= 1e-5 and t1["bytes"] == t0["bytes"]
        assert stats["skipped"] == 0 and engine.get_version() == controller.get_version() == 1
        # One adapter on the server, under the one name, from version 1's directory.
        body = json.dumps({"lora_name": "policy"}).encode()
        req_unload = urllib.request.Request(server.url + "/unload_lora_adapter", body,
                                            {"Content-Type": "application/json"})
        assert pub.transfer.current.name.startswith("policy-v1-") and not dir0.exists()
    finally:
        pub.close()
    with urllib.request.urlopen(req_unload, timeout=5) as r:
        assert json.loads(r.read())["loaded_adapters"] == {}

    k = c.output_versions.count(0)
    assert len(c.output_ids) == budget and 0 < k < budget
    assert c.output_versions == [0] * k + [1] * (budget - k) and c.n_interruptions == 1
    got = torch.tensor(c.output_logprobs)
    ids = prompt + c.output_ids
    old = logp_of(engine.reference(), ids, len(prompt))  # version 0: B = 0, the base model
    new = logp_of(engine, ids, len(prompt))
    assert (got[:k] - old[:k]).abs().max().item() <= 1e-5
    assert (got[k:] - new[k:]).abs().max().item() <= 1e-5
    assert (got[k:] - old[k:]).abs().max().item() > 1e-3  # the new adapter changed the policy
    engine.destroy()
