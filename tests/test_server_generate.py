"""The embedded server end to end: a real `python -m arealite.server` child on 127.0.0.1.

Log-probs are checked against a plain Hugging Face forward of the same model,
so batching, padding, KV-cache merging and positions are all under test.
"""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest
import torch

from arealite.server.process import ServerProcess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server_gen") / "server.log"
    proc = ServerProcess(tiny_model_dir, free_port(), extra_args=["--random-seed", "7", "--max-batch-size", "16"],
                         log_path=log, threads=1)
    try:
        yield proc.wait_healthy()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        yield s


async def post(http, server, path, body, status=200):
    async with http.post(server.url + path, json=body) as r:
        data = await r.json(content_type=None) if (await r.read()) else None
        assert r.status == status, (path, r.status, data)
        return data


def hf_logprobs(model, prompt, output, temperature):
    """log_softmax(logits / T) of each output token, from one unpadded forward."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    t = temperature if temperature >= 1e-6 else 1.0
    return torch.log_softmax(logits / t, dim=-1), torch.log_softmax(logits / t, dim=-1).gather(
        1, torch.tensor(output)[:, None])[:, 0]


async def generated_tokens(http, server) -> int:
    """Tokens the server has generated since it started (from /get_server_info)."""
    async with http.get(server.url + "/get_server_info") as r:
        return (await r.json())["internal_states"][0]["generated_tokens"]


def prompt_of(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 500, (n,), generator=g).tolist()


async def test_logprobs_match_hf_forward_under_concurrent_batching(server, http, hf_model):
    # Different prompt lengths, budgets, temperatures and filters, all in flight together.
    temps = [1.0, 0.7, 1.0, 0.7, 0.0, 0.7, 1.0, 0.7]
    reqs = []
    for i, t in enumerate(temps):
        sp = {"max_new_tokens": 6 + 5 * i, "temperature": t, "ignore_eos": True}
        if i == 5:
            sp.update(top_p=0.8, top_k=50)  # the log-prob stays the full-vocabulary one
        reqs.append({"input_ids": prompt_of(3 + 4 * i, i), "sampling_params": sp, "return_logprob": True,
                     "rid": f"lp-{i}"})
    outs = await asyncio.gather(*(post(http, server, "/generate", r) for r in reqs))
    for req, out, t in zip(reqs, outs, temps):
        meta = out["meta_info"]
        assert meta["id"] == req["rid"]
        assert meta["finish_reason"] == {"type": "length", "length": req["sampling_params"]["max_new_tokens"]}
        assert meta["prompt_tokens"] == len(req["input_ids"])
        assert meta["completion_tokens"] == len(out["output_ids"]) == req["sampling_params"]["max_new_tokens"]
        lps = meta["output_token_logprobs"]
        assert [x[1] for x in lps] == out["output_ids"] and all(x[2] is None for x in lps)
        full, ref = hf_logprobs(hf_model, req["input_ids"], out["output_ids"], t)
        got = torch.tensor([x[0] for x in lps])
        assert (got - ref).abs().max().item() <= 1e-5, (t, (got - ref).abs().max().item())
        if t == 0.0:  # greedy: every token is the argmax
            assert full.argmax(-1).tolist() == out["output_ids"]
    info = await (await http.get(server.url + "/get_server_info")).json()
    assert info["internal_states"][0]["max_running"] >= 4, "concurrent requests were not batched together"


async def test_top_logprobs_are_the_most_likely_tokens_of_the_same_distribution(server, http, hf_model):
    # Two requests in one batch, one asking for 5 top tokens and one for none (SGLang's shape).
    prompt = prompt_of(7, 11)
    sp = {"max_new_tokens": 6, "temperature": 0.7, "ignore_eos": True}
    asked, plain = await asyncio.gather(
        post(http, server, "/generate", {"input_ids": prompt, "sampling_params": sp, "return_logprob": True,
                                         "top_logprobs_num": 5}),
        post(http, server, "/generate", {"input_ids": prompt, "sampling_params": sp, "return_logprob": True}))
    assert "output_top_logprobs" not in plain["meta_info"]
    top = asked["meta_info"]["output_top_logprobs"]
    full, chosen = hf_logprobs(hf_model, prompt, asked["output_ids"], 0.7)
    assert len(top) == len(asked["output_ids"]) == 6
    for pos, entries in enumerate(top):
        assert len(entries) == 5 and all(e[2] is None for e in entries)
        want_lp, want_ids = full[pos].topk(5)
        assert [e[1] for e in entries] == want_ids.tolist()
        assert max(abs(e[0] - w) for e, w in zip(entries, want_lp.tolist())) <= 1e-5
        assert entries[0][0] >= chosen[pos].item() - 1e-6  # the sampled token is never likelier than the top one
    for bad in (-1, 65, 1.5, "3", True):
        await post(http, server, "/generate", {"input_ids": prompt, "sampling_params": sp, "return_logprob": True,
                                               "top_logprobs_num": bad}, status=400)
    # Without return_logprob SGLang reports no log-probs at all, top ones included.
    out = await post(http, server, "/generate", {"input_ids": prompt, "sampling_params": sp, "top_logprobs_num": 3})
    assert "output_top_logprobs" not in out["meta_info"]


async def test_greedy_is_deterministic_and_batch_returns_a_list(server, http):
    body = {"input_ids": prompt_of(9, 100), "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    a = await post(http, server, "/generate", body)
    # Same prompt again, now alongside other traffic in the batch.
    noise = {"input_ids": prompt_of(20, 101), "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}
    b, _ = await asyncio.gather(post(http, server, "/generate", body), post(http, server, "/generate", noise))
    assert a["output_ids"] == b["output_ids"]
    batch = await post(http, server, "/generate", {
        "input_ids": [body["input_ids"], prompt_of(4, 102)], "rid": ["b0", "b1"],
        "sampling_params": body["sampling_params"]})
    assert isinstance(batch, list) and [o["meta_info"]["id"] for o in batch] == ["b0", "b1"]
    assert batch[0]["output_ids"] == a["output_ids"]


async def test_top_k_1_and_tiny_top_p_sample_the_greedy_token(server, http):
    p = prompt_of(7, 200)
    greedy = await post(http, server, "/generate", {"input_ids": p, "sampling_params": {
        "max_new_tokens": 10, "temperature": 0, "ignore_eos": True}})
    for extra in ({"top_k": 1}, {"top_p": 1e-4}, {"min_p": 1.0}):
        out = await post(http, server, "/generate", {"input_ids": p, "sampling_params": {
            "max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True, **extra}})
        assert out["output_ids"] == greedy["output_ids"], extra


async def test_sampling_seed_is_reproducible(server, http):
    def body(seed):
        return {"input_ids": prompt_of(5, 300),
                "sampling_params": {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": seed, "ignore_eos": True}}

    a = await post(http, server, "/generate", body(123))
    noise = {"input_ids": prompt_of(11, 301), "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}}
    b, _ = await asyncio.gather(post(http, server, "/generate", body(123)), post(http, server, "/generate", noise))
    c = await post(http, server, "/generate", body(124))
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]


async def test_stop_token_ids_end_generation_with_matched(server, http):
    p = prompt_of(6, 400)
    free = await post(http, server, "/generate", {"input_ids": p, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "ignore_eos": True}})
    stop = free["output_ids"][4]
    cut = free["output_ids"].index(stop) + 1
    out = await post(http, server, "/generate", {"input_ids": p, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "stop_token_ids": [stop]}})
    if out["meta_info"]["finish_reason"]["matched"] == stop:
        assert out["output_ids"] == free["output_ids"][:cut]
    else:  # the model's EOS came first
        assert len(out["output_ids"]) < cut
    # As SGLang: ignore_eos turns stop_token_ids off too.
    kept = await post(http, server, "/generate", {"input_ids": p, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "stop_token_ids": [stop]}})
    assert kept["output_ids"] == free["output_ids"]
    assert kept["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


async def test_text_input_returns_text(server, http, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    out = await post(http, server, "/generate", {"text": "What is 2 + 3?", "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}})
    assert out["meta_info"]["prompt_tokens"] == len(tok.encode("What is 2 + 3?"))
    assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True)
    by_ids = await post(http, server, "/generate", {"input_ids": tok.encode("What is 2 + 3?"), "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}})
    assert by_ids["output_ids"] == out["output_ids"] and "text" in by_ids


async def test_abort_request_by_rid_prefix(server, http):
    long = {"max_new_tokens": 1000, "ignore_eos": True}
    before = await generated_tokens(http, server)
    tasks = [asyncio.create_task(post(http, server, "/generate", {
        "input_ids": prompt_of(5, 500 + i), "sampling_params": long, "rid": rid}))
        for i, rid in enumerate(["grp-a-0", "grp-a-1", "other"])]
    while await generated_tokens(http, server) < before + 30:
        await asyncio.sleep(0.01)
    res = await post(http, server, "/abort_request", {"rid": "grp-a"})
    assert res["num_aborted"] == 2
    a0, a1 = await tasks[0], await tasks[1]
    for a in (a0, a1):
        assert a["meta_info"]["finish_reason"]["type"] == "abort"
        assert a["meta_info"]["finish_reason"]["message"]
        assert 0 < len(a["output_ids"]) == a["meta_info"]["completion_tokens"] < 1000
    assert not tasks[2].done()
    await post(http, server, "/abort_request", {"abort_all": True})
    assert (await tasks[2])["meta_info"]["finish_reason"]["type"] == "abort"


async def test_info_routes_and_weight_version(server, http):
    info = await (await http.get(server.url + "/get_server_info")).json()
    assert info["version"] == "0.5.23" and info["engine"] == "arealite-embedded"
    assert info["model_path"] and "weight_version" in info and "api_key" not in info
    minfo = await (await http.get(server.url + "/get_model_info")).json()
    assert minfo["is_generation"] is True and minfo["model_path"] == info["model_path"]
    assert (await http.get(server.url + "/health_generate")).status == 200
    # Two requests of one prompt in turn: the second copies the first's prompt work.
    for _ in range(2):
        await post(http, server, "/generate", {"input_ids": [9, 8, 7, 6], "sampling_params": {"max_new_tokens": 1}})
    state = (await (await http.get(server.url + "/get_server_info")).json())["internal_states"][0]
    assert state["prompt_cache_hits"] >= 1 and state["prompt_cache_entries"] >= 1
    flushed = await post(http, server, "/flush_cache", {})
    assert flushed["success"] is True and "prompt cache flushed" in flushed["message"]
    state = (await (await http.get(server.url + "/get_server_info")).json())["internal_states"][0]
    assert state["prompt_cache_entries"] == 0
    res = await post(http, server, "/update_weight_version", {"new_version": "v7"})
    assert res["success"] is True
    info = await (await http.get(server.url + "/get_server_info")).json()
    out = await post(http, server, "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
    minfo = await (await http.get(server.url + "/get_model_info")).json()
    assert info["weight_version"] == out["meta_info"]["weight_version"] == minfo["weight_version"] == "v7"


async def test_get_weights_by_name_returns_the_first_rows(server, http, hf_model):
    # SGLang's shape: tensor.tolist()[:truncate_size], i.e. rows of a 2-D weight.
    state = hf_model.state_dict()
    for name, n in (("model.layers.0.mlp.up_proj.weight", 3), ("model.norm.weight", 5), ("lm_head.weight", 2)):
        got = await post(http, server, "/get_weights_by_name", {"name": name, "truncate_size": n})
        assert torch.equal(torch.tensor(got), state[name][:n]), name
    whole = await post(http, server, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 10**6})
    assert torch.equal(torch.tensor(whole), state["model.norm.weight"])


BAD_GENERATE = [
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, 100000]}, "out of the vocabulary"),
    ({"input_ids": [1, -3]}, "out of the vocabulary"),
    ({"input_ids": [1, "a"]}, "input_ids"),
    ({"input_ids": [[1, 2], []]}, "input_ids[1]"),
    ({"input_ids": [1, 2], "text": "x"}, "exactly one of input_ids or text"),
    ({"sampling_params": {}}, "exactly one of input_ids or text"),
    ({"input_ids": [1], "sampling_params": {"foo": 1}}, "sampling_params.foo"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "5"}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"temperature": -0.5}}, "sampling_params.temperature"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
    ({"input_ids": [1], "sampling_params": {"min_p": 2}}, "sampling_params.min_p"),
    ({"input_ids": [1], "sampling_params": {"n": 2}}, "sampling_params.n"),
    ({"input_ids": [1], "sampling_params": {"ignore_eos": "yes"}}, "sampling_params.ignore_eos"),
    ({"input_ids": [1], "sampling_params": {"repetition_penalty": 1.2}}, "not supported"),
    ({"input_ids": [1], "sampling_params": {"stop": ["x"]}}, "not supported"),
    ({"input_ids": [1], "sampling_params": {"json_schema": "{}"}}, "not supported"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": [99999]}}, "sampling_params.stop_token_ids"),
    ({"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 1020}}, "context length"),
    ({"input_ids": [1], "stream": True}, "stream"),
    ({"input_ids": [1], "return_logprob": True, "logprob_start_len": 5}, "logprob_start_len"),
    ({"input_ids": [1], "return_hidden_states": True}, "return_hidden_states"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [[1], [2]], "rid": "x"}, "rid"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
    ([1, 2, 3], "JSON object"),
]


@pytest.mark.parametrize("body, needle", BAD_GENERATE, ids=[n for _, n in BAD_GENERATE])
async def test_bad_generate_requests_are_400_naming_the_field(server, http, body, needle):
    data = await post(http, server, "/generate", body, status=400)
    assert needle in data["error"]["message"], data


BAD_ADMIN = [
    ("/generate", "not json", "not valid JSON"),
    ("/update_weights_from_disk", {}, "model_path"),
    ("/update_weights_from_disk", {"model_path": "/x", "bogus": 1}, "bogus"),
    ("/get_weights_by_name", {"name": "no.such.weight"}, "no.such.weight"),
    ("/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": 0}, "truncate_size"),
    ("/update_weights_from_distributed", {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1]],
                                          "group_name": "nope"}, "init_weights_update_group"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float99"], "shapes": [[1]]}, "dtypes[0]"),
    ("/update_weights_from_distributed", {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1]]}, "equal length"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                    "world_size": 2, "group_name": "g", "backend": "mpi"}, "backend"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0,
                                    "world_size": 2, "group_name": "g"}, "rank_offset"),
    ("/pause_generation", {"mode": "freeze"}, "mode"),
    ("/abort_request", {}, "rid"),
    ("/update_weight_version", {}, "new_version"),
]


@pytest.mark.parametrize("path, body, needle", BAD_ADMIN, ids=[f"{p}-{n}" for p, _, n in BAD_ADMIN])
async def test_bad_admin_requests_are_400(server, http, path, body, needle):
    kw = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, str) else {"json": body}
    async with http.post(server.url + path, **kw) as r:
        data = await r.json(content_type=None)
        assert r.status == 400, data
    assert needle in json.dumps(data), data
