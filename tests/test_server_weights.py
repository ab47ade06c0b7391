"""Weight updates of a real embedded server child process: from disk and over gloo.

The test process plays trainer rank 0: it hosts the TCPStore, joins the group
built over ``PrefixStore(group_name, store)`` while the server joins through
``/init_weights_update_group``, and broadcasts the tensors while the server's
``/update_weights_from_distributed`` call is in flight.
"""

from __future__ import annotations

import asyncio
import datetime
import shutil
import socket

import aiohttp
import pytest
import torch
import torch.distributed as dist

from arealite.server.process import ServerProcess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


pytestmark = pytest.mark.timeout(180)

TIMEOUT = datetime.timedelta(seconds=60)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server_w") / "server.log"
    proc = ServerProcess(tiny_model_dir, free_port(), extra_args=["--api-key", "k-secret-123"], log_path=log,
                         threads=1)
    try:
        yield proc.wait_healthy()
    finally:
        proc.stop()
    assert "k-secret-123" not in log.read_text(), "the api key leaked into the server log"


@pytest.fixture(scope="module")
def seed1_dir(tmp_path_factory):
    from arealite.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_seed1"), size="small", seed=1)


@pytest.fixture
async def http():
    headers = {"Authorization": "Bearer k-secret-123"}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=90)) as s:
        yield s


async def post(http, server, path, body, status=200):
    async with http.post(server.url + path, json=body) as r:
        data = await r.json(content_type=None)
        assert r.status == status, (path, r.status, data)
        return data


async def generated_tokens(http, server) -> int:
    async with http.get(server.url + "/get_server_info") as r:
        return (await r.json())["internal_states"][0]["generated_tokens"]


def load_hf(path, overrides=None):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if overrides:
        with torch.no_grad():
            sd = m.state_dict()
            for k, v in overrides.items():
                sd[k].copy_(v)
    return m


def max_logprob_error(model, prompt, out, temperature=1.0):
    ids = torch.tensor([prompt + out["output_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    ref = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(out["output_ids"])[:, None])[:, 0]
    got = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
    return (got - ref).abs().max().item()


async def test_api_key_is_required_except_for_health(server):
    async with aiohttp.ClientSession() as anon:
        # As SGLang: every path starting with /health is a probe that needs no key.
        for path in ("/health", "/health_generate"):
            assert (await anon.get(server.url + path)).status == 200
        assert (await anon.get(server.url + "/get_server_info")).status == 401
        for path in ("/update_weights_from_disk", "/update_weight_version", "/get_weights_by_name"):
            assert (await anon.post(server.url + path, json={})).status == 401
        r = await anon.post(server.url + "/generate", json={"input_ids": [1]})
        assert r.status == 401
        r = await anon.post(server.url + "/generate", json={"input_ids": [1]},
                            headers={"Authorization": "Bearer wrong"})
        assert r.status == 401
        r = await anon.post(server.url + "/pause_generation", json={}, headers={"Authorization": "k-secret-123"})
        assert r.status == 401  # the Bearer scheme is required
        info = await (await anon.get(server.url + "/get_server_info",
                                     headers={"Authorization": "Bearer k-secret-123"})).json()
        assert "k-secret-123" not in str(info)


async def test_pause_update_from_disk_continue(server, http, tiny_model_dir, seed1_dir, tmp_path):
    prompt = list(range(10, 22))
    budget = 200
    long = {"max_new_tokens": budget, "ignore_eos": True, "temperature": 1.0}
    before = await generated_tokens(http, server)
    first = asyncio.create_task(post(http, server, "/generate", {
        "input_ids": prompt, "sampling_params": long, "return_logprob": True, "rid": "long"}))
    while await generated_tokens(http, server) < before + 5:  # pause mid-generation
        await asyncio.sleep(0.005)
    await post(http, server, "/pause_generation", {"mode": "abort"})
    partial = await asyncio.wait_for(first, 10)
    meta = partial["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    n_done = len(partial["output_ids"])
    assert 0 < n_done < budget and meta["completion_tokens"] == n_done
    assert max_logprob_error(load_hf(tiny_model_dir), prompt, partial) <= 1e-5

    # A request sent while paused waits for continue_generation.
    waiting = asyncio.create_task(post(http, server, "/generate", {
        "input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}))
    await asyncio.sleep(0.5)
    assert not waiting.done()

    # A checkpoint lacking a tensor is refused and changes nothing.
    broken = tmp_path / "broken"
    shutil.copytree(seed1_dir, broken)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(broken / "model.safetensors"))
    del sd["model.norm.weight"]
    save_file(sd, str(broken / "model.safetensors"), metadata={"format": "pt"})
    bad = await post(http, server, "/update_weights_from_disk", {"model_path": str(broken), "weight_version": "9"},
                     status=400)
    assert bad["success"] is False and "model.norm.weight" in bad["message"]
    bad = await post(http, server, "/update_weights_from_disk", {"model_path": str(tmp_path / "nowhere")},
                     status=400)
    assert bad["success"] is False and "nowhere" in bad["message"]

    res = await post(http, server, "/update_weights_from_disk", {"model_path": str(seed1_dir), "weight_version": "1"})
    assert res["success"] is True, res
    await post(http, server, "/continue_generation", {})
    done = await asyncio.wait_for(waiting, 20)
    assert done["meta_info"]["finish_reason"]["type"] == "length"
    assert done["meta_info"]["weight_version"] == "1"

    # The client's partial-rollout resume: prompt + partial, smaller budget.
    resumed = await post(http, server, "/generate", {
        "input_ids": prompt + partial["output_ids"], "return_logprob": True,
        "sampling_params": {**long, "max_new_tokens": budget - n_done}})
    assert resumed["meta_info"]["finish_reason"] == {"type": "length", "length": budget - n_done}
    assert resumed["meta_info"]["weight_version"] == "1"
    new_model = load_hf(seed1_dir)
    assert max_logprob_error(new_model, prompt + partial["output_ids"], resumed) <= 1e-5
    info = await (await http.get(server.url + "/get_server_info")).json()
    assert info["weight_version"] == "1" and info["model_path"] == str(seed1_dir)


async def test_bad_checkpoint_from_disk_is_refused_and_keeps_the_old_weights(server, http, seed1_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    good = load_file(str(seed1_dir / "model.safetensors"))
    probes = ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0.mlp.up_proj.weight"]

    async def server_weights() -> dict[str, list]:
        return {n: await post(http, server, "/get_weights_by_name", {"name": n, "truncate_size": 4}) for n in probes}

    async def load(name: str, tensors: dict[str, torch.Tensor], status=200) -> dict:
        d = tmp_path / name
        shutil.copytree(seed1_dir, d)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        return await post(http, server, "/update_weights_from_disk", {"model_path": str(d), "weight_version": name},
                          status=status)

    before = await server_weights()
    version = (await (await http.get(server.url + "/get_server_info")).json())["weight_version"]
    # Every other tensor differs from what the server holds: a partial copy would show.
    shifted = {n: t + 0.5 for n, t in good.items()}
    up = "model.layers.0.mlp.up_proj.weight"
    bad_cases = [
        ("shape", {**shifted, up: shifted[up][:-1]}, [up, "shape"]),
        ("extra", {**shifted, "model.extra.weight": torch.zeros(3)}, ["model.extra.weight", "not a weight"]),
        ("dtype", {**shifted, "model.norm.weight": shifted["model.norm.weight"].to(torch.int32)},
         ["model.norm.weight", "torch.int32", str(good["model.norm.weight"].dtype)]),
    ]
    for case, tensors, needles in bad_cases:
        bad = await load(case, tensors, status=400)
        assert bad["success"] is False and all(x in bad["message"] for x in needles), (case, bad)
        assert await server_weights() == before, case
    info = await (await http.get(server.url + "/get_server_info")).json()
    assert info["weight_version"] == version

    # Another floating dtype is cast to the server's on load (SGLang does the same).
    res = await load("float64", {n: t.double() for n, t in good.items()})
    assert res["success"] is True, res
    for n, values in (await server_weights()).items():
        assert torch.equal(torch.tensor(values), good[n][:4].float()), n


class Trainer:
    """Rank 0 of the weight-update group, as the trainer would be."""

    def __init__(self, port: int, world_size: int, group_name: str):
        self.store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, timeout=TIMEOUT,
                                   wait_for_workers=False)
        self.group_name = group_name
        self.world_size = world_size
        self.pg = None

    def join(self) -> None:
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(self.group_name, self.store), 0, self.world_size, TIMEOUT)

    def broadcast(self, tensors: list[torch.Tensor], flattened: bool) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if flattened:
            tensors = [torch.cat([t.flatten() for t in tensors])]
        for t in tensors:
            self.pg.broadcast([t.contiguous()], opts).wait()


async def push(http, server, trainer, names, tensors, *, flattened=False, version=None, meta_override=None,
               status=200):
    """Post the update and broadcast concurrently, as the trainer does."""
    meta = {"names": names, "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "shapes": [list(t.shape) for t in tensors], "group_name": trainer.group_name,
            "flattened_bucket": flattened, "flush_cache": True}
    if version is not None:
        meta["weight_version"] = version
    meta.update(meta_override or {})
    await post(http, server, "/begin_weight_update", {})  # SGLang >= 0.5.21: one session per update
    try:
        req = asyncio.create_task(post(http, server, "/update_weights_from_distributed", meta, status=status))
        await asyncio.to_thread(trainer.broadcast, tensors, flattened)
        return await asyncio.wait_for(req, 60)
    finally:
        await post(http, server, "/end_weight_update", {})


async def test_update_weights_from_distributed(server, http, seed1_dir):
    # (Runs after the disk test: the server holds the seed-1 weights.)
    base = load_hf(seed1_dir)
    state = base.state_dict()
    gen = torch.Generator().manual_seed(5)
    names = [n for n in state if n != "lm_head.weight"]  # tied to the embedding
    new = {n: state[n] + 0.05 * torch.randn(state[n].shape, generator=gen) for n in names}

    trainer = Trainer(free_port(), 2, "wsync-test")
    init = asyncio.create_task(post(http, server, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": trainer.store.port, "rank_offset": 1, "world_size": 2,
        "group_name": "wsync-test", "backend": "gloo"}))
    await asyncio.to_thread(trainer.join)
    assert (await asyncio.wait_for(init, 60))["success"] is True

    # Two buckets: one tensor per broadcast, then one flattened broadcast.
    half = len(names) // 2
    b1, b2 = names[:half], names[half:]
    r1 = await push(http, server, trainer, b1, [new[n] for n in b1], version="2")
    assert r1["success"] is True, r1
    # SGLang's spelling of the flat layout (what arealite's client sends).
    r2 = await push(http, server, trainer, b2, [new[n] for n in b2], flattened=True, version="3",
                    meta_override={"flattened_bucket": None, "load_format": "flattened_bucket"})
    assert r2["success"] is True, r2
    for n in (b1[0], b1[-1], b2[0], b2[-1], "lm_head.weight"):
        src = new["model.embed_tokens.weight" if n == "lm_head.weight" else n]
        got = await post(http, server, "/get_weights_by_name", {"name": n, "truncate_size": 16})
        assert torch.allclose(torch.tensor(got), src[:16]), n
    updated = load_hf(seed1_dir, new)
    prompt = list(range(30, 40))
    out = await post(http, server, "/generate", {"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}})
    assert out["meta_info"]["weight_version"] == "3"
    assert max_logprob_error(updated, prompt, out) <= 1e-5

    # Bad metadata: refused with the tensor named, the broadcast is still drained,
    # the old weights keep serving and the group keeps working.
    target = "model.layers.0.mlp.up_proj.weight"
    junk = torch.randn(7, 3)
    bad = await push(http, server, trainer, [target], [junk], version="bad", status=400)
    assert bad["success"] is False and target in bad["message"] and "shape" in bad["message"]
    bad = await push(http, server, trainer, [target], [new[target].double()], status=400)
    assert bad["success"] is False and "dtype" in bad["message"]
    bad = await push(http, server, trainer, ["model.no_such.weight", target], [junk, new[target]], flattened=True,
                     status=400)
    assert bad["success"] is False and "model.no_such.weight" in bad["message"]
    got = await post(http, server, "/get_weights_by_name", {"name": target, "truncate_size": 8})
    assert torch.allclose(torch.tensor(got), new[target][:8])
    info = await (await http.get(server.url + "/get_server_info")).json()
    assert info["weight_version"] == "3"

    final = new[target] * 0.5
    ok = await push(http, server, trainer, [target], [final], version="4")
    assert ok["success"] is True
    got = await post(http, server, "/get_weights_by_name", {"name": target, "truncate_size": 8})
    assert torch.allclose(torch.tensor(got), final[:8])

    # A new-style begin/end bracket holds admission, like a pause.
    await post(http, server, "/begin_weight_update", {})
    held = asyncio.create_task(post(http, server, "/generate", {"input_ids": [3, 4], "sampling_params": {
        "max_new_tokens": 2}}))
    await asyncio.sleep(0.3)
    assert not held.done()
    await post(http, server, "/end_weight_update", {})
    assert (await asyncio.wait_for(held, 20))["meta_info"]["weight_version"] == "4"

    res = await post(http, server, "/destroy_weights_update_group", {"group_name": "wsync-test"})
    assert res["success"] is True
    await post(http, server, "/destroy_weights_update_group", {"group_name": "wsync-test"}, status=400)


def test_receive_buffers_are_reused_across_buckets_and_never_shared():
    from arealite.server.weights import ReceiveBuffers

    bufs = ReceiveBuffers(torch.device("cpu"))
    a = bufs.take([torch.float32, torch.bfloat16], [(3, 5), (7,)])
    assert a.numel() == 128, "each tensor starts on a 64-byte boundary"
    b = bufs.take([torch.float32], [(10,)])
    assert b.data_ptr() != a.data_ptr(), "a buffer still in use is not handed out twice"
    bufs.give_back(a)
    bufs.give_back(b)
    c = bufs.take([torch.float32], [(4,)])
    assert c.data_ptr() in (a.data_ptr(), b.data_ptr()), "the next bucket reuses a spare buffer"
    assert bufs.take([torch.float32], [(4,)]).data_ptr() != c.data_ptr()
    big = bufs.take([torch.uint8], [(4096,)])
    assert big.numel() == 4096 and big.data_ptr() not in (a.data_ptr(), b.data_ptr())
    for buf in (c, big, torch.empty(1, dtype=torch.uint8)):
        bufs.give_back(buf)
    assert bufs.take([torch.uint8], [(4096,)]).data_ptr() == big.data_ptr(), "the largest are kept"
