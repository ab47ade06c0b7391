"""The whole interruptible path: client, a real weight update from disk, continue.

A long generation runs on the embedded server through ``SGLangClient``;
mid-way the client pauses the server, loads a perturbed copy of the model from
disk as version 1 and continues. The completion must be seamless: the requested
length, the old version's tokens first, and every log-prob that of the model
that produced the token.
"""

from __future__ import annotations

import asyncio
import shutil
import time

import aiohttp
import pytest
import torch

from arealite.api.types import GenerationRequest, SamplingParams
from arealite.config.schema import RolloutConfig
from arealite.inference_client.sglang_client import SGLangClient
from arealite.server.process import ServerProcess
from tests.conftest import free_port, perturbed_weights

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture
def server(micro_model_dir, tmp_path):
    proc = ServerProcess(micro_model_dir, free_port(), log_path=tmp_path / "server.log", threads=1)
    try:
        yield proc.wait_healthy()
    finally:
        proc.stop()


@pytest.fixture
def new_model_dir(micro_model_dir, base_state, tmp_path):
    """The micro model with perturbed weights: version 1, as the trainer writes it."""
    from safetensors.torch import save_file

    out = tmp_path / "v1"
    shutil.copytree(micro_model_dir, out)
    new = perturbed_weights(base_state, seed=1)
    new.pop("lm_head.weight", None)  # tied to the embedding (safetensors refuses shared tensors)
    save_file({k: v.contiguous() for k, v in new.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def token_logprobs(model_dir, ids: list[int], n_prompt: int) -> torch.Tensor:
    """log p(token | prefix) of ``ids[n_prompt:]`` from one fp32 HF forward (temperature 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, n_prompt - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[n_prompt:])[:, None])[:, 0]


async def generated_tokens(url: str) -> int:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/get_server_info") as resp:
            return (await resp.json())["internal_states"][0]["generated_tokens"]


async def test_generation_across_a_weight_update_from_disk(server, micro_model_dir, new_model_dir):
    prompt = list(range(10, 22))
    budget = 300
    sp = SamplingParams(max_new_tokens=budget, temperature=1.0, ignore_eos=True)
    cfg = RolloutConfig(request_timeout_s=30, request_retries=0)
    async with SGLangClient([server.url], cfg) as eng:
        await eng.initialize(timeout=60)
        before = await generated_tokens(server.url)
        task = asyncio.create_task(eng.agenerate(GenerationRequest(prompt, sp)))
        deadline = time.monotonic() + 30
        while await generated_tokens(server.url) < before + 5:  # pause mid-generation
            assert time.monotonic() < deadline, f"no tokens generated:\n{server.log_tail()}"
            await asyncio.sleep(0.005)
        assert not task.done(), "generation finished before the pause; raise the budget"
        await eng.pause_generation()
        await eng.update_weights_from_disk(str(new_model_dir), version=1)
        await eng.continue_generation()
        c = await asyncio.wait_for(task, 60)
        st = eng.stats()

    k = c.output_versions.count(0)
    assert len(c.output_ids) == budget and c.finish_reason == "length"
    assert 0 < k < budget and c.output_versions == [0] * k + [1] * (budget - k)
    assert c.n_interruptions == 1 and st["retries"] == 0 and c.input_ids == prompt
    ids = prompt + c.output_ids
    got = torch.tensor(c.output_logprobs)
    old = token_logprobs(micro_model_dir, ids, len(prompt))
    new = token_logprobs(new_model_dir, ids, len(prompt))
    assert (got[:k] - old[:k]).abs().max().item() <= 1e-5
    assert (got[k:] - new[k:]).abs().max().item() <= 1e-5
    assert (got[k:] - old[k:]).abs().max().item() > 1e-3  # the update did change the policy
