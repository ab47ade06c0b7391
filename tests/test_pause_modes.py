"""Weight updates that keep generation going: SGLang's ``in_place`` and ``retract`` pauses.

A long answer runs on the real embedded server through ``SGLangClient``; mid-way the client
pauses the server in the run's ``weight_sync.pause_mode``, loads other weights from disk as a
new version and continues. Nothing is cut or resubmitted: one request, no interruption, and
each token carries the version of the weights that sampled it (SGLang's
``meta_info.weight_versions``), with the log-prob of the distribution it was sampled from:

- ``in_place``: the KV cache computed under the old weights is kept, so the tokens after the
  push are the new weights reading the old weights' cache;
- ``retract``: the answer goes back to the queue and its KV is recomputed under the new weights.

The trainer's staleness filter sees the oldest token's version.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import aiohttp
import pytest
import torch

from arealite.api.types import GenerationRequest, SamplingParams
from arealite.config.schema import RolloutConfig
from arealite.inference_client.sglang_client import SGLangClient
from arealite.rollout.staleness import trajectory_staleness
from arealite.server.process import ServerProcess
from tests.conftest import free_port, perturbed_weights

pytestmark = [pytest.mark.timeout(180)]

PROMPT = list(range(10, 22))
BUDGET = 120


@pytest.fixture(scope="module")
def server(micro_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("pause_modes") / "server.log"
    proc = ServerProcess(micro_model_dir, free_port(), log_path=log, threads=1)
    try:
        yield proc.wait_healthy()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def other_model_dir(micro_model_dir, base_state, tmp_path_factory):
    """The micro model with perturbed weights, as the trainer writes a new version."""
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("pause_modes_v") / "model"
    shutil.copytree(micro_model_dir, out)
    new = perturbed_weights(base_state, seed=1)
    new.pop("lm_head.weight", None)  # tied to the embedding
    save_file({k: v.contiguous() for k, v in new.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def load(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def logprobs_of(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids)[:, None])[:, 0]


@torch.no_grad()
def sampled_logprobs(old_dir, new_dir, out: list[int], k: int, kv_kept: bool) -> torch.Tensor:
    """The log-probs of the distributions that sampled ``out``: its first ``k`` tokens by the old
    weights; the rest by the new ones, reading the old weights' cache of ``PROMPT + out[:k-1]``
    (``kv_kept``: in_place; the last sampled token was not in the cache yet) or their own."""
    old, new = load(old_dir), load(new_dir)
    ids = PROMPT + out
    n = len(PROMPT)
    first = logprobs_of(old(input_ids=torch.tensor([ids])).logits[0, n - 1:n + k - 1], out[:k])
    if not kv_kept:
        rest = logprobs_of(new(input_ids=torch.tensor([ids])).logits[0, n + k - 1:-1], out[k:])
        return torch.cat([first, rest])
    cache = old(input_ids=torch.tensor([ids[:n + k - 1]]), use_cache=True).past_key_values
    pos = torch.arange(n + k - 1, len(ids) - 1)[None]
    logits = new(input_ids=torch.tensor([ids[n + k - 1:-1]]), past_key_values=cache, position_ids=pos).logits[0]
    return torch.cat([first, logprobs_of(logits, out[k:])])


async def generated_tokens(url: str) -> int:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/get_server_info") as resp:
            return (await resp.json())["internal_states"][0]["generated_tokens"]


async def post(url: str, route: str, body: dict) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + route, data=json.dumps(body).encode(),
                                headers={"Content-Type": "application/json"}) as resp:
            return resp.status, await resp.text()


async def push_mid_answer(server, mode: str, model_dir, version: int, checks=None):
    """One answer with a push of ``model_dir`` as ``version`` in the middle, paused in ``mode``."""
    sp = SamplingParams(max_new_tokens=BUDGET, temperature=1.0, ignore_eos=True)
    async with SGLangClient([server.url], RolloutConfig(request_timeout_s=30, request_retries=0),
                            pause_mode=mode) as eng:
        await eng.initialize(timeout=60)
        before = await generated_tokens(server.url)
        task = asyncio.create_task(eng.agenerate(GenerationRequest(PROMPT, sp)))
        deadline = time.monotonic() + 30
        while await generated_tokens(server.url) < before + 5:
            assert time.monotonic() < deadline, f"no tokens generated:\n{server.log_tail()}"
            await asyncio.sleep(0.005)
        assert not task.done(), "the answer finished before the pause; raise BUDGET"
        await eng.pause_generation()
        if checks is not None:
            await checks()
        await eng.update_weights_from_disk(str(model_dir), version=version)
        await eng.continue_generation()
        c = await asyncio.wait_for(task, 60)
        return c, eng.stats()


def check_versions(c, st, old: int, new: int) -> int:
    k = c.output_versions.count(old)
    assert len(c.output_ids) == BUDGET and c.finish_reason == "length"
    assert 0 < k < BUDGET and c.output_versions == [old] * k + [new] * (BUDGET - k)
    assert c.n_interruptions == 0 and st["aborts"] == 0 and st["retries"] == 0  # nothing cut or resubmitted
    # The staleness filter counts from the oldest token: trained at `new`, the answer is one version old.
    versions = torch.tensor([c.output_versions])
    assert trajectory_staleness(versions, torch.ones_like(versions, dtype=torch.bool), new).tolist() == [new - old]
    return k


async def test_in_place_push_keeps_the_answer_and_its_old_kv(server, micro_model_dir, other_model_dir):
    async def strict_refusals():
        # SGLang cannot flush with requests frozen in the batch: the flush route answers 400, and a
        # load that asks for a flush (its default) would kill the scheduler; the stand-in refuses it.
        status, text = await post(server.url, "/flush_cache", {})
        assert status == 400 and "pending requests" in text
        status, text = await post(server.url, "/update_weights_from_disk", {"model_path": str(other_model_dir)})
        assert status == 400 and "flush_cache: false" in text

    c, st = await push_mid_answer(server, "in_place", other_model_dir, 1, strict_refusals)
    k = check_versions(c, st, 0, 1)
    ref = sampled_logprobs(micro_model_dir, other_model_dir, c.output_ids, k, kv_kept=True)
    got = torch.tensor(c.output_logprobs)
    assert (got - ref).abs().max().item() <= 1e-5
    clean = sampled_logprobs(micro_model_dir, other_model_dir, c.output_ids, k, kv_kept=False)
    assert (got[k:] - clean[k:]).abs().max().item() > 1e-4  # the old KV did shape the later tokens


async def test_retract_push_recomputes_the_answer_under_new_weights(server, micro_model_dir, other_model_dir):
    status, text = await post(server.url, "/update_weights_from_disk",
                              {"model_path": str(other_model_dir), "weight_version": "1"})
    assert status == 200, text
    c, st = await push_mid_answer(server, "retract", micro_model_dir, 2)
    k = check_versions(c, st, 1, 2)
    ref = sampled_logprobs(other_model_dir, micro_model_dir, c.output_ids, k, kv_kept=False)
    assert (torch.tensor(c.output_logprobs) - ref).abs().max().item() <= 1e-5
