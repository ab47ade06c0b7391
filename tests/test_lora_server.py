"""The embedded server's LoRA routes: load/unload by name and path, ``lora_path`` on /generate,
and log-probs equal to the LoRA trainer's forward (fp32, CPU)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch

from arealite.config.schema import ActorConfig, LoraConfig
from arealite.lora import LoraFSDPEngine
from arealite.server.process import ServerProcess
from tests.conftest import free_port
from tests.test_fsdp import LENGTHS, label_logp, make_batch, n_tokens, token_mean_ce

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def trained(micro_model_dir, tmp_path_factory):
    """A LoRA engine after two steps, its adapter written as a PEFT directory."""
    cfg = ActorConfig(model_path=str(micro_model_dir), mb_max_tokens=64,
                      lora=LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"]))
    cfg.optimizer.lr = 1e-2
    engine = LoraFSDPEngine(cfg, device="cpu").initialize(total_steps=4)
    batch = make_batch(engine.hf_config.vocab_size, LENGTHS)
    for _ in range(2):
        engine.train_batch(batch, token_mean_ce, n_tokens)
    out = tmp_path_factory.mktemp("adapter") / "a1"
    engine.export_hf(out)
    yield engine, out
    engine.destroy()


@pytest.fixture(scope="module")
def server(micro_model_dir, tmp_path_factory):
    proc = ServerProcess(micro_model_dir, free_port(), log_path=tmp_path_factory.mktemp("log") / "server.log",
                         threads=1)
    try:
        yield proc.wait_healthy().url
    finally:
        proc.stop()


async def post(url, route, body):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + route, json=body) as r:
            return r.status, await r.json()


def score_body(ids, lora):
    return {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "lora_path": lora,
            "sampling_params": {"max_new_tokens": 1, "temperature": 1.0}}


def engine_logp(engine, ids, adapters=True):
    t = torch.tensor([ids])
    batch = {"input_ids": t, "attention_mask": torch.ones_like(t, dtype=torch.bool)}
    if adapters:
        return engine.forward(batch, label_logp)[0, 1:]
    return engine.reference().forward(batch, label_logp)[0, 1:]


async def test_adapter_logprobs_equal_the_trainers_forward(server, trained):
    engine, path = trained
    status, ans = await post(server, "/load_lora_adapter", {"lora_name": "policy-v1", "lora_path": str(path)})
    assert status == 200 and ans["success"] and ans["loaded_adapters"] == {"policy-v1": str(path)}
    ids = [int(x) for x in torch.randint(5, engine.hf_config.vocab_size, (24,), generator=torch.Generator().manual_seed(0))]
    ids2 = ids[:13]
    # One batch: two prompts with the adapter, one without, run together.
    answers = await asyncio.gather(post(server, "/generate", score_body(ids, "policy-v1")),
                                   post(server, "/generate", score_body(ids, None)),
                                   post(server, "/generate", score_body(ids2, "policy-v1")))
    for (status, ans), prompt, adapters in zip(answers, (ids, ids, ids2), (True, False, True)):
        assert status == 200, ans
        got = torch.tensor([e[0] for e in ans["meta_info"]["input_token_logprobs"][1:]])
        want = engine_logp(engine, prompt, adapters)
        assert (got - want).abs().max().item() <= 1e-5
    with_a, base = (torch.tensor([e[0] for e in a[1]["meta_info"]["input_token_logprobs"][1:]]) for a in answers[:2])
    assert (with_a - base).abs().max().item() > 1e-3  # the adapter is applied

    status, ans = await post(server, "/load_lora_adapter", {"lora_name": "policy-v1", "lora_path": str(path)})
    assert status == 400 and not ans["success"] and "already loaded" in ans["error_message"]
    status, ans = await post(server, "/unload_lora_adapter", {"lora_name": "policy-v1"})
    assert status == 200 and ans["success"] and ans["loaded_adapters"] == {}
    status, ans = await post(server, "/generate", score_body(ids, "policy-v1"))
    assert status == 400 and "not loaded" in ans["error"]["message"]


async def test_bad_adapters_are_refused_naming_why(server, trained, tmp_path):
    status, ans = await post(server, "/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert status == 400 and "adapter_config.json" in ans["error_message"]
    status, ans = await post(server, "/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and "lora_path" in ans["error"]["message"]
    status, ans = await post(server, "/unload_lora_adapter", {"lora_name": "never"})
    assert status == 400 and "LoRA with name never does not exist" in ans["error_message"]  # SGLang's words
    status, ans = await post(server, "/generate", {**score_body([5, 6, 7], None), "lora_path": 3})
    assert status == 400 and "lora_path" in ans["error"]["message"]


async def test_a_request_sent_during_a_pause_looks_its_adapter_up_after_it(server, trained):
    """SGLang resolves ``lora_path`` after the pause wait: a push may unload and load the name
    while paused, and requests that arrived meanwhile run on what is loaded at continue."""
    engine, path = trained
    ids = list(range(5, 21))
    status, _ = await post(server, "/pause_generation", {"mode": "abort"})
    assert status == 200
    try:
        pending = asyncio.ensure_future(post(server, "/generate", score_body(ids, "reloaded")))
        await asyncio.sleep(0.5)
        assert not pending.done(), "a request naming an adapter not loaded yet was answered during the pause"
        status, ans = await post(server, "/load_lora_adapter", {"lora_name": "reloaded", "lora_path": str(path)})
        assert status == 200, ans
    finally:
        await post(server, "/continue_generation", {})
    status, ans = await asyncio.wait_for(pending, 30)
    assert status == 200, ans
    got = torch.tensor([e[0] for e in ans["meta_info"]["input_token_logprobs"][1:]])
    assert (got - engine_logp(engine, ids)).abs().max().item() <= 1e-5
    status, ans = await post(server, "/unload_lora_adapter", {"lora_name": "reloaded"})
    assert status == 200
