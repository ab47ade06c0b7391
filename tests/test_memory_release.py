"""Release and resume of an embedded server's memory (SGLang's ``/release_memory_occupation``
and ``/resume_memory_occupation``), measured on the server process's RSS.

One server on a ~5M-parameter model (20 MB of float32 weights, enough to stand out of
the RSS noise), driven through the real client's admin as the colocated loop drives it:
pause, release, (the trainer would train here), resume, push weights by tensor handles,
continue.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from arealite.inference_client.sglang_client import SGLangClient
from arealite.server.process import ServerProcess
from arealite.utils.net import free_port

PROMPT = [5, 17, 33, 2, 9, 40]
SAMPLE = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 7}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from arealite.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("memory_model"), size="base", seed=0, num_hidden_layers=4)


@pytest.fixture(scope="module")
def server(model_dir):
    proc = ServerProcess(model_dir, free_port(), threads=1)
    try:
        yield proc.wait_healthy(120)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def admin(server, loop_runner):
    client = SGLangClient([server.url.removeprefix("http://")])
    loop_runner(client.initialize(60))
    yield client.admin
    loop_runner(client.aclose())


def _post(url: str, route: str, body: dict | None = None, timeout: float = 60) -> tuple[int, object]:
    req = urllib.request.Request(url + route, data=json.dumps(body or {}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _rss(pid: int) -> int:
    import os

    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _checkpoint(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    (path,) = model_dir.glob("*.safetensors")
    return {k: v.clone() for k, v in load_file(str(path)).items()}


def _generate(url: str) -> list[int]:
    status, out = _post(url, "/generate", {"input_ids": PROMPT, "sampling_params": SAMPLE})
    assert status == 200, out
    return out["output_ids"]


def test_release_frees_the_memory_requests_wait_and_generation_after_resume_is_token_identical(
        server, admin, loop_runner, model_dir):
    url, pid = server.url, server.proc.pid
    before = _generate(url)
    weights = _checkpoint(model_dir)
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())

    loop_runner(admin.pause_generation())
    rss0 = _rss(pid)
    (answer,) = loop_runner(admin.release_memory_occupation()).values()
    rss1 = _rss(pid)
    freed = sum(answer["bytes"].values())
    assert answer["released"] == ["cuda_graph", "kv_cache", "weights"]
    assert answer["bytes"]["weights"] >= 0.9 * weight_bytes  # every parameter (the tied head once)
    assert rss0 - rss1 >= 0.9 * freed, f"RSS fell by {rss0 - rss1} bytes of the {freed} released"

    # A request arriving while released waits (as SGLang's, which the pause holds).
    held: dict = {}
    waiter = threading.Thread(target=lambda: held.update(ids=_generate(url)), daemon=True)
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive(), "a request ran while the weights were released"
    status, info = _post(url, "/server_info")
    assert info["internal_states"][0]["memory"]["released"] == ["cuda_graph", "kv_cache", "weights"]

    (answer,) = loop_runner(admin.resume_memory_occupation()).values()
    assert _rss(pid) - rss1 >= 0.9 * answer["bytes"]["weights"]
    # SGLang's resumed weights have no defined contents (here: zeros) until weights are pushed.
    status, values = _post(url, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 4})
    assert status == 200 and not any(values)

    loop_runner(admin.begin_weight_update())
    try:
        loop_runner(admin.update_weights_from_tensor(list(weights.items()), 3))
    finally:
        loop_runner(admin.end_weight_update())
    loop_runner(admin.continue_generation())
    waiter.join(60)
    assert held["ids"] == before, "generation after resume and push differs from before the release"
    assert _generate(url) == before
    status, info = _post(url, "/get_model_info")
    assert info["weight_version"] == "3"


def test_a_release_while_requests_run_is_refused_and_an_unreleased_resume_is_a_no_op(server, admin, loop_runner):
    url = server.url
    done: dict = {}
    t = threading.Thread(target=lambda: done.update(r=_post(url, "/generate", {
        "input_ids": PROMPT, "sampling_params": {**SAMPLE, "max_new_tokens": 64}})), daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while _post(url, "/server_info")[1]["internal_states"][0]["num_running_reqs"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)
    status, out = _post(url, "/pause_generation", {"mode": "in_place"})  # frozen, still running
    assert status == 200
    status, out = _post(url, "/release_memory_occupation", {"tags": ["weights"]})
    assert status == 400 and "idle" in out["error"]["message"] and "pause_generation" in out["error"]["message"]
    status, out = _post(url, "/release_memory_occupation", {"tags": ["activations"]})
    assert status == 400 and "kv_cache" in out["error"]["message"]
    status, out = _post(url, "/resume_memory_occupation", {"tags": ["weights"]})
    assert status == 200 and out["bytes"] == {}
    assert _post(url, "/continue_generation")[0] == 200
    t.join(60)
    assert done["r"][0] == 200 and len(done["r"][1]["output_ids"]) == 64
