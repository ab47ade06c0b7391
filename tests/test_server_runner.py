"""The continuous-batching runner in process: joins, leaves, stops, pauses.

Sequences join a batch that is already decoding (KV caches of different
lengths merged with left padding) and leave it (rows dropped, padding columns
trimmed); every log-prob must still equal an unpadded HF forward.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from arealite.server.args import ServerArgs
from arealite.server.app import create_server
from arealite.server.generate_request import GenerateInput
from arealite.server.sampling import SamplingConfig

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def srv(micro_model_dir):
    s = create_server(ServerArgs(model_path=str(micro_model_dir), random_seed=3, max_batch_size=8))
    yield s
    s.runner.shutdown()


def req(rid, ids, **sp):
    return GenerateInput(rid=rid, input_ids=ids, sampling=SamplingConfig(**sp), return_logprob=True)


def check_logprobs(model, seq, temperature):
    ids = torch.tensor([seq.inp.input_ids + seq.output_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(seq.inp.input_ids) - 1:-1].float()
    ref = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(seq.output_ids)[:, None])[:, 0]
    err = (torch.tensor(seq.output_logprobs) - ref).abs().max().item()
    assert err <= 1e-5, (seq.inp.rid, err)


async def wait_tokens(runner, n):
    start = runner.stats["generated_tokens"]
    while runner.stats["generated_tokens"] < start + n:
        await asyncio.sleep(0.002)


async def test_sequences_join_and_leave_a_running_batch(srv):
    r = srv.runner
    prefills = r.stats["prefills"]
    a = asyncio.create_task(r.generate(req("a", list(range(5, 35)), max_new_tokens=60, ignore_eos=True)))
    await wait_tokens(r, 5)
    # Shorter and longer prompts join mid-flight; "b" leaves early.
    b = asyncio.create_task(r.generate(req("b", [9, 8, 7], max_new_tokens=4, ignore_eos=True, temperature=0.7)))
    c = asyncio.create_task(r.generate(req("c", list(range(40, 100)), max_new_tokens=30, ignore_eos=True)))
    await wait_tokens(r, 10)
    d = asyncio.create_task(r.generate(req("d", [11, 12], max_new_tokens=20, ignore_eos=True, top_k=5)))
    seqs = await asyncio.gather(a, b, c, d)
    assert r.stats["prefills"] - prefills >= 3, "requests did not join a running batch"
    for s, t in zip(seqs, (1.0, 0.7, 1.0, 1.0)):
        assert len(s.output_ids) == s.inp.sampling.max_new_tokens
        assert s.finish_reason == {"type": "length", "length": s.inp.sampling.max_new_tokens}
        check_logprobs(srv.model, s, t)
    assert r.n_running == 0 and r._cache is None  # the batch is fully released


async def test_max_new_tokens_zero_returns_nothing(srv):
    s = await srv.runner.generate(req("z", [1, 2, 3], max_new_tokens=0))
    assert s.output_ids == [] and s.finish_reason == {"type": "length", "length": 0}


async def test_pause_in_place_freezes_and_continue_resumes(srv):
    r = srv.runner
    task = asyncio.create_task(r.generate(req("frozen", [4, 5, 6], max_new_tokens=200, ignore_eos=True)))
    await wait_tokens(r, 3)
    await r.call(lambda: r.set_paused(True, "in_place"))
    frozen_at = r.stats["generated_tokens"]
    await asyncio.sleep(0.2)
    assert r.stats["generated_tokens"] == frozen_at and not task.done()
    await r.call(lambda: r.set_paused(False))
    s = await asyncio.wait_for(task, 30)
    assert s.finish_reason["type"] == "length" and len(s.output_ids) == 200
    check_logprobs(srv.model, s, 1.0)


async def test_pause_abort_returns_running_and_waiting_requests(srv):
    # As SGLang's abort mode (abort_request(abort_all=True)): the waiting queue is dropped
    # too, so nothing waits in the server to start on the weights about to be replaced.
    r = srv.runner  # max_batch_size 8: two of these ten wait
    tasks = [asyncio.create_task(r.generate(req(f"q{i}", [4, 5, 6 + i], max_new_tokens=500, ignore_eos=True)))
             for i in range(10)]
    while r.n_running < 8:
        await asyncio.sleep(0.002)
    await wait_tokens(r, 8)
    assert r.n_waiting == 2
    await r.call(lambda: r.set_paused(True, "abort"))
    try:
        done = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    finally:
        await r.call(lambda: r.set_paused(False))
    assert all(s.finish_reason["type"] == "abort" for s in done)
    assert sorted(len(s.output_ids) == 0 for s in done) == [False] * 8 + [True] * 2
    assert r.n_waiting == 0 and r.n_running == 0


async def test_eos_stops_unless_ignored(micro_model_dir, tmp_path):
    # Make the model's eos the token greedy decoding produces second, so that
    # the stop is certain.
    probe = create_server(ServerArgs(model_path=str(micro_model_dir)))
    try:
        free = await probe.runner.generate(req("p", [20, 21, 22], max_new_tokens=5, temperature=0.0, ignore_eos=True))
    finally:
        probe.runner.shutdown()
    eos = free.output_ids[1]
    d = tmp_path / "eos_model"
    shutil.copytree(micro_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (d / "config.json").write_text(json.dumps(cfg))
    srv = create_server(ServerArgs(model_path=str(d), skip_tokenizer_init=True))
    try:
        assert srv.tokenizer is None
        stop = await srv.runner.generate(req("s", [20, 21, 22], max_new_tokens=5, temperature=0.0))
        cut = free.output_ids.index(eos) + 1
        assert stop.output_ids == free.output_ids[:cut]
        assert stop.finish_reason == {"type": "stop", "matched": eos}
        cont = await srv.runner.generate(req("i", [20, 21, 22], max_new_tokens=5, temperature=0.0, ignore_eos=True))
        assert cont.output_ids == free.output_ids and cont.finish_reason["type"] == "length"
        assert "text" not in srv.format_output(cont)
    finally:
        srv.runner.shutdown()


async def test_samples_of_one_prompt_share_its_prefill(srv):
    """A group's samples admitted together run their prompt once (as SGLang's prefix cache
    serves repeats); each row still samples on its own and its log-probs match HF."""
    r = srv.runner
    shared = r.stats["shared_prefill_rows"]
    prompt, other = list(range(3, 21)), [7, 8, 9]
    reqs = [req(f"g{i}", prompt, max_new_tokens=12, ignore_eos=True) for i in range(5)]
    reqs.append(req("other", other, max_new_tokens=12, ignore_eos=True))
    seqs = await asyncio.gather(*(r.generate(x) for x in reqs))
    assert r.stats["shared_prefill_rows"] - shared == 4
    assert [s.cached_tokens for s in seqs] == [0, 17, 17, 17, 17, 0]
    assert len({tuple(s.output_ids) for s in seqs[:5]}) > 1, "shared rows must sample independently"
    for s in seqs:
        check_logprobs(srv.model, s, 1.0)
    # Greedy: a shared row continues exactly as the prompt run alone does.
    alone = await r.generate(req("alone", prompt, max_new_tokens=12, ignore_eos=True, temperature=0.0))
    pair = await asyncio.gather(*(r.generate(req(f"p{i}", prompt, max_new_tokens=12, ignore_eos=True,
                                                 temperature=0.0)) for i in range(2)))
    assert pair[0].output_ids == pair[1].output_ids == alone.output_ids


@pytest.fixture
def small(micro_model_dir):
    """A server with room for 4 sequences: a group of 8 samples joins in two admissions."""
    s = create_server(ServerArgs(model_path=str(micro_model_dir), random_seed=5, max_batch_size=4))
    yield s
    s.runner.shutdown()


async def test_a_group_split_over_admissions_runs_its_prompt_once(small):
    """The samples that join after the first admission copy the prompt's cached KV and
    logits (no forward, as SGLang's radix cache serves a repeated prompt); each still
    samples on its own, with log-probs equal to an unpadded HF forward."""
    r = small.runner
    assert r.stats["prefills"] == 0 and r.prompt_cache.hits == 0  # a fresh server
    prompt = list(range(4, 19))
    seqs = await asyncio.gather(*(r.generate(req(f"s{i}", prompt, max_new_tokens=6, ignore_eos=True))
                                  for i in range(8)))
    assert r.stats["prefills"] == 1, "the second admission must not run the prompt again"
    assert r.stats["prompt_cache_rows"] == 1 and r.stats["shared_prefill_rows"] == 6
    assert [s.cached_tokens for s in seqs] == [0] + [len(prompt) - 1] * 7
    assert r.prompt_cache.hits == 1 and len(r.prompt_cache) == 1
    assert len({tuple(s.output_ids) for s in seqs[4:]}) > 1, "rows from the cache must sample independently"
    for s in seqs:
        check_logprobs(small.model, s, 1.0)


async def test_a_command_on_the_model_thread_clears_the_prompt_cache(small):
    """Weights change only through commands: after one, a cached prompt runs again on the
    new weights (a stale cache would give the old model's log-probs)."""
    r = small.runner
    prompt = [9, 3, 7, 5, 2]
    first = await r.generate(req("a", prompt, max_new_tokens=4, ignore_eos=True, temperature=0.0))
    again = await r.generate(req("b", prompt, max_new_tokens=4, ignore_eos=True, temperature=0.0))
    assert r.stats["prefills"] == 1 and again.cached_tokens == len(prompt) - 1
    assert again.output_ids == first.output_ids
    weight = small.model.get_input_embeddings().weight
    saved = weight.detach().clone()
    try:
        await r.call(lambda: weight.data.mul_(3.0))
        assert len(r.prompt_cache) == 0
        changed = await r.generate(req("c", prompt, max_new_tokens=4, ignore_eos=True, temperature=0.0))
        assert r.stats["prefills"] == 2 and changed.cached_tokens == 0
        check_logprobs(small.model, changed, 1.0)
    finally:
        await r.call(lambda: weight.data.copy_(saved))


async def test_prompt_cache_off_runs_every_admission(micro_model_dir):
    s = create_server(ServerArgs(model_path=str(micro_model_dir), max_batch_size=4, prompt_cache_entries=0))
    try:
        r = s.runner
        seqs = await asyncio.gather(*(r.generate(req(f"s{i}", [5, 6, 7, 8], max_new_tokens=3, ignore_eos=True))
                                      for i in range(8)))
        assert r.stats["prefills"] == 2 and r.stats["prompt_cache_rows"] == 0 and len(r.prompt_cache) == 0
        assert [x.cached_tokens for x in seqs] == [0, 3, 3, 3, 0, 3, 3, 3]
    finally:
        s.runner.shutdown()


async def test_prompt_log_probs_bypass_the_prompt_cache(small):
    """A request for prompt log-probs needs the prompt's forward: it neither reads nor fills the cache."""
    r = small.runner
    prompt = [3, 4, 5, 6, 7, 8]
    await r.generate(req("warm", prompt, max_new_tokens=2, ignore_eos=True))
    inp = req("lp", prompt, max_new_tokens=2, ignore_eos=True)
    inp.logprob_start_len = 0
    s = await r.generate(inp)
    assert s.cached_tokens == 0 and len(s.input_logprobs) == len(prompt) and r.stats["prefills"] == 2
