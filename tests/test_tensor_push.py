"""``/update_weights_from_tensor`` against the strict stand-in (SGLang's payload shape and
refusals), the tensor-handle wire format, and what launches and checks the colocated routes.

The server: one strict embedded server on the micro model with ``--enable-memory-saver``,
weights readable back; the refusal of a release without the flag runs on the route alone.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import urllib.error
import urllib.request

import pytest
import torch
from conftest import perturbed_weights

from arealite.config.cross_field_checks import check_config
from arealite.config.launch_checks import check_launch
from arealite.config.loader import ConfigError
from arealite.config.schema import ArealiteConfig
from arealite.inference_client.errors import ServerAdminError
from arealite.inference_client.sglang_client import SGLangClient
from arealite.server.command_line import embedded_server_command, sglang_server_command
from arealite.server.process import ServerProcess
from arealite.utils.net import free_port
from arealite.utils.tensor_handles import TensorPayloadError, decode_named_tensors, encode_named_tensors


@pytest.fixture(scope="module")
def strict_server(micro_model_dir):
    proc = ServerProcess(micro_model_dir, free_port(), threads=1, extra_args=[
        "--strict-sglang", "--skip-server-warmup", "--readback-architectures", "all", "--enable-memory-saver"])
    try:
        yield proc.wait_healthy(120).url
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def admin(strict_server, loop_runner):
    client = SGLangClient([strict_server.removeprefix("http://")])
    loop_runner(client.initialize(60))
    yield client.admin
    loop_runner(client.aclose())


def _post(url: str, route: str, body: dict | None = None) -> tuple[int, object]:
    req = urllib.request.Request(url + route, data=json.dumps(body or {}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _message(answer: object) -> str:
    return answer["message"] if "message" in answer else answer["error"]["message"]


def test_handles_round_trip_in_process_and_foreign_globals_are_refused():
    a, b = torch.arange(6.0).reshape(2, 3), torch.ones(4, dtype=torch.bfloat16)
    entry = encode_named_tensors([("a", a), ("b", b)])
    assert len(entry) < 2000, "handles, not bytes"
    (na, ta), (nb, tb) = decode_named_tensors(entry)
    assert (na, nb) == ("a", "b") and torch.equal(ta, a) and torch.equal(tb, b) and tb.dtype == torch.bfloat16

    evil = base64.b64encode(pickle.dumps(print)).decode()  # any callable outside the list
    with pytest.raises(TensorPayloadError, match="builtins.print"):
        decode_named_tensors(evil)
    with pytest.raises(TensorPayloadError, match="base64"):
        decode_named_tensors("not base64 !")
    buf = io.BytesIO()
    pickle.dump({"a": 1}, buf)
    with pytest.raises(TensorPayloadError, match=r"list of \(name, tensor\) pairs"):
        decode_named_tensors(base64.b64encode(buf.getvalue()).decode())


def test_strict_push_needs_a_session_then_the_server_holds_the_tensors(strict_server, admin, loop_runner,
                                                                       base_state):
    new = perturbed_weights(base_state, 5)
    with pytest.raises(ServerAdminError, match="between begin_weight_update"):
        loop_runner(admin.update_weights_from_tensor(list(new.items()), 4))
    loop_runner(admin.begin_weight_update())
    try:
        loop_runner(admin.update_weights_from_tensor(list(new.items())[:3], None))  # a first bucket: no label
        assert _post(strict_server, "/get_model_info")[1]["weight_version"] == "0"
        loop_runner(admin.update_weights_from_tensor(list(new.items())[3:], 4))
    finally:
        loop_runner(admin.end_weight_update())
    for name, t in new.items():
        status, values = _post(strict_server, "/get_weights_by_name", {"name": name, "truncate_size": 10**6})
        assert status == 200 and torch.equal(torch.tensor(values).flatten(), t.flatten()), name
    assert _post(strict_server, "/get_model_info")[1]["weight_version"] == "4"


@pytest.mark.parametrize("change, expect", [
    (lambda b: b.pop("serialized_named_tensors"), "serialized_named_tensors"),
    (lambda b: b.update(serialized_named_tensors=b["serialized_named_tensors"] * 2), "tp_size 1"),
    (lambda b: b.update(serialized_named_tensors=[]), "one entry per"),
    (lambda b: b.update(load_format="flattened_bucket"), "load_format"),
    (lambda b: b.update(flush_cache="yes"), "flush_cache"),
    (lambda b: b.update(serialized_named_tensors=["%%%"]), "base64"),
    (lambda b: b.update(serialized_named_tensors=[encode_named_tensors([("no.such.weight", torch.ones(2))])]),
     "no.such.weight"),
    (lambda b: b.update(serialized_named_tensors=[encode_named_tensors([("model.norm.weight", torch.ones(3))])]),
     "shape"),
])
def test_a_malformed_payload_is_refused_with_the_field_named(strict_server, base_state, change, expect):
    body = {"serialized_named_tensors": [encode_named_tensors([("model.norm.weight", base_state["model.norm.weight"])])],
            "flush_cache": True}
    change(body)
    assert _post(strict_server, "/begin_weight_update")[0] == 200
    try:
        status, answer = _post(strict_server, "/update_weights_from_tensor", body)
    finally:
        _post(strict_server, "/end_weight_update")
    assert status == 400 and expect in _message(answer), answer


def test_strict_memory_routes_refuse_what_sglang_refuses(strict_server, admin, loop_runner):
    status, answer = _post(strict_server, "/resume_memory_occupation", {"tags": ["kv_cache"]})
    assert status == 400 and "were not released" in _message(answer)
    loop_runner(admin.pause_generation())
    (answer,) = loop_runner(admin.release_memory_occupation(["kv_cache"])).values()
    assert answer is None  # SGLang's route returns nothing
    status, answer = _post(strict_server, "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert status == 400 and "already released" in _message(answer)
    loop_runner(admin.continue_generation())
    try:  # released and not paused: SGLang would run it on released memory
        status, answer = _post(strict_server, "/generate", {"input_ids": [1, 2], "sampling_params": {
            "max_new_tokens": 1}})
        assert status == 400 and "pause_generation" in _message(answer)
    finally:
        loop_runner(admin.pause_generation())
        loop_runner(admin.resume_memory_occupation(["kv_cache"]))
        loop_runner(admin.continue_generation())
    status, answer = _post(strict_server, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
    assert status == 200


def test_strict_release_without_the_memory_saver_flag_is_refused():
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from arealite.server.memory_routes import MemoryRoutes
    from arealite.server.strict import SGLangBehaviour

    routes = MemoryRoutes(torch.nn.Linear(2, 2), runner=None, behaviour=SGLangBehaviour(strict=True),
                          memory_saver=False, weights_cpu_backup=False, own_weights=lambda: None)
    app = web.Application()
    for path, handler in routes.routes().items():
        app.router.add_post(path, handler)

    async def ask() -> tuple[int, dict]:
        async with TestClient(TestServer(app)) as client:
            resp = await client.post("/release_memory_occupation", json={"tags": ["weights"]})
            return resp.status, await resp.json()

    status, answer = asyncio.run(ask())
    assert status == 400 and "--enable-memory-saver" in _message(answer)
    assert "server.enable_memory_saver" in _message(answer)


def test_memory_saver_flag_reaches_both_launch_commands_and_tensor_needs_local_capable_servers():
    cfg = ArealiteConfig.model_validate({"server": {"enable_memory_saver": True}, "actor": {"model_path": "/m"},
                                         "weight_sync": {"method": "tensor"}})
    assert "--enable-memory-saver" in embedded_server_command(cfg, 30000)
    assert "--enable-memory-saver" in sglang_server_command(cfg, 30000)
    plain = ArealiteConfig.model_validate({"actor": {"model_path": "/m"}})
    assert "--enable-memory-saver" not in embedded_server_command(plain, 30000)
    check_config(cfg, check_paths=False)
    cfg.launch.server_backend = "sim"
    with pytest.raises(ConfigError, match="weight_sync.method") as err:
        check_config(cfg, check_paths=False)
    assert "distributed" in str(err.value)
    cfg.launch.server_backend = "embedded"
    cfg.launch.n_servers = 0
    cfg.launch.server_addrs = ["127.0.0.1:30000", "10.255.255.1:30000"]
    with pytest.raises(ConfigError, match="10.255.255.1:30000"):
        check_launch(cfg, environ={})
