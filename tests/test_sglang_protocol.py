"""SGLang's HTTP protocol, route by route, against two backends.

The same tests run against arealite's embedded server in strict mode (always), against a
simulated server (the embedded server's app with a GPU cost model, ``--sim``), and
against a real SGLang server when one can run: on a CUDA machine with SGLang installed
and ``AREALITE_SGLANG_MODEL`` naming a model directory (``ci/gpu.sh`` sets it up), so
the day a GPU is there one command says whether the real path behaves as the client
expects. Each test states the SGLang source it follows (see docs/sglang.md).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port

SGLANG_MODEL = os.environ.get("AREALITE_SGLANG_MODEL")


def _request(addr: str, route: str, body: dict | None = None, timeout: float = 30) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{addr}{route}", data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw.decode(errors="replace")


def _wait_ready(proc: subprocess.Popen, addr: str, log: Path, timeout: float, route: str = "/model_info") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{log.read_text()[-3000:]}")
        try:
            if _request(addr, route, timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"server not ready in {timeout}s:\n{log.read_text()[-3000:]}")


class Backend:
    """One running server and what the tests may expect of it."""

    def __init__(self, name: str, addr: str, proc: subprocess.Popen, readback: bool):
        self.name, self.addr, self.proc, self.readback = name, addr, proc, readback

    def call(self, route: str, body: dict | None = None, timeout: float = 30):
        return _request(self.addr, route, body, timeout)


def _start(name: str, micro_model_dir: Path, tmp: Path) -> Backend:
    port = free_port()
    log = tmp / f"{name}.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", SGLANG_HEALTH_CHECK_TIMEOUT="3")
    if name in ("embedded", "sim"):
        cmd = [sys.executable, "-m", "arealite.server", "--model-path", str(micro_model_dir),
               "--port", str(port), "--strict-sglang"]
        if name == "sim":  # the same app, a GPU cost model instead of the model (forwarded to arealite.sim)
            cmd.append("--sim")
        readback, timeout = False, 90  # the tiny model is a Qwen2: SGLang cannot read it back
    else:
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", SGLANG_MODEL, "--port", str(port),
               "--host", "127.0.0.1", "--mem-fraction-static", "0.5", "--skip-tokenizer-init",
               "--weight-version", "0"]
        arch = json.loads((Path(SGLANG_MODEL) / "config.json").read_text()).get("architectures", [])
        readback, timeout = bool({"LlamaForCausalLM", "MistralForCausalLM"} & set(arch)), 600
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    addr = f"127.0.0.1:{port}"
    try:
        # Wait until the start-up warm-up is over (SGLang's /ready): before it, /health answers 503
        # at once, and a simulated warm-up takes a simulated GPU's time (8 decode steps).
        _wait_ready(proc, addr, log, timeout, "/ready" if name in ("embedded", "sim") else "/model_info")
    except BaseException:
        proc.kill()
        raise
    return Backend(name, addr, proc, readback)


@pytest.fixture(scope="module", params=["embedded", "sim", pytest.param("sglang", marks=pytest.mark.gpu)])
def backend(request, micro_model_dir, tmp_path_factory):
    if request.param == "sglang":
        pytest.importorskip("sglang")
        if not SGLANG_MODEL:
            pytest.skip("set AREALITE_SGLANG_MODEL to a model directory to test a real SGLang server")
    b = _start(request.param, micro_model_dir, tmp_path_factory.mktemp(request.param))
    yield b
    b.proc.terminate()
    try:
        b.proc.wait(20)
    except subprocess.TimeoutExpired:
        b.proc.kill()


def _gen(b: Backend, ids, **extra):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, "temperature": 0.0},
            "return_logprob": True, **extra}
    return b.call("/generate", body)


def test_info_routes_and_their_aliases(backend):
    """http_server.py: /server_info (/get_server_info deprecated), /model_info (/get_model_info)."""
    for route in ("/server_info", "/get_server_info"):
        status, info = backend.call(route)
        assert status == 200 and isinstance(info.get("version"), str), (route, info)
    for route in ("/model_info", "/get_model_info"):
        status, info = backend.call(route)
        assert status == 200 and "weight_version" in info, (route, info)


def test_openapi_lists_the_weight_update_routes(backend):
    """FastAPI's /openapi.json: how a client learns which routes a server has."""
    status, doc = backend.call("/openapi.json")
    assert status == 200
    for route in ("/generate", "/begin_weight_update", "/end_weight_update", "/update_weights_from_distributed",
                  "/pause_generation", "/continue_generation", "/model_info"):
        assert route in doc["paths"], route


def test_generate_returns_output_and_prompt_logprobs(backend):
    """io_struct.GenerateReqInput / api_types.GenerateRequest; logprob_result_processor.py."""
    ids = [5, 6, 7, 8]
    status, out = _gen(backend, ids, logprob_start_len=0)
    assert status == 200, out
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] in ("length", "stop")
    assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == ids and entries[0][0] is None
    assert all(e[0] <= 0 for e in entries[1:])


def test_unknown_top_level_keys_are_ignored_unknown_sampling_keys_refused(backend):
    """GenerateRequest ignores unknown keys (what SGLang's router adds); SamplingParams rejects them."""
    status, out = _gen(backend, [5, 6], model=None, background=False, no_logs=False, log_metrics=True)
    assert status == 200, out
    status, out = backend.call("/generate", {"input_ids": [5, 6], "sampling_params": {"bogus_param": 1}})
    assert status == 400, out


def test_health_generates_and_waits_while_paused(backend):
    """http_server.health_generate: /health runs a one-token generation (environ.py default on);
    paused, it cannot, and fails after SGLANG_HEALTH_CHECK_TIMEOUT; /model_info still answers."""
    assert backend.call("/health")[0] == 200
    assert backend.call("/pause_generation", {"mode": "abort"})[0] == 200
    try:
        t0 = time.monotonic()
        status, _ = backend.call("/health", timeout=60)
        assert status != 200 and time.monotonic() - t0 >= 2.5
        assert backend.call("/model_info", timeout=5)[0] == 200
    finally:
        assert backend.call("/continue_generation", {})[0] == 200
    assert backend.call("/health")[0] == 200


def test_weight_update_session_is_enforced(backend):
    """scheduler_components/weight_updater.py: begin twice, end without begin and a distributed
    update outside a session are refused; a session left open blocks the next begin."""
    status, out = backend.call("/update_weights_from_distributed", {
        "names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "none"})
    assert status == 400
    assert backend.call("/begin_weight_update", {})[0] == 200
    try:
        status, out = backend.call("/begin_weight_update", {})
        assert status == 400 and "already open" in out["message"], out
    finally:
        assert backend.call("/end_weight_update", {})[0] == 200
    status, out = backend.call("/end_weight_update", {})
    assert status == 400 and "no weight-update session" in out["message"], out


def test_readback_works_only_where_the_model_class_has_it(backend):
    """weight_exporter.get_weights_by_name: None (400 'Get parameter by name failed') for model
    classes without it (Qwen2); a value list for Llama and friends."""
    status, out = backend.call("/get_weights_by_name", {"name": "model.embed_tokens.weight", "truncate_size": 2})
    if backend.readback:
        assert status == 200 and isinstance(out, list), out
    else:
        assert status == 400 and out["error"]["message"] == "Get parameter by name failed", out


def test_pause_aborts_running_requests_with_their_partial_output(backend):
    """tokenizer_manager pause_generation(mode=abort): in-flight requests return finish_reason abort."""
    with cf.ThreadPoolExecutor(1) as pool:
        # Long enough to be running when the pause comes (the micro model's context is 1024).
        fut = pool.submit(backend.call, "/generate", {
            "input_ids": [5, 6], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 100000 if backend.name == "sglang" else 1000, "ignore_eos": True}})
        _wait_running(backend)
        assert backend.call("/pause_generation", {"mode": "abort"})[0] == 200
        try:
            status, out = fut.result(60)
        finally:
            backend.call("/continue_generation", {})
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort", out


def _wait_running(b: Backend, timeout: float = 30) -> None:
    """Until the server has a request running (its /server_info says so, as SGLang's does)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = b.call("/server_info")[1].get("internal_states") or [{}]
        if "num_running_reqs" not in states[0]:  # a server that does not say: give it a moment
            time.sleep(1.0)
            return
        if states[0]["num_running_reqs"] > 0:
            return
        time.sleep(0.02)
    raise AssertionError("the request never started running")


def test_weight_version_is_reported_and_settable(backend):
    """server_args.weight_version / /update_weight_version: what tags every generated token."""
    assert backend.call("/update_weight_version", {"new_version": "7"})[0] == 200
    status, out = _gen(backend, [5, 6])
    assert status == 200 and out["meta_info"]["weight_version"] == "7"
    assert backend.call("/update_weight_version", {"new_version": "0"})[0] == 200


def test_in_place_pause_keeps_the_answer_and_splits_its_versions(backend):
    """Scheduler.pause_generation(mode=in_place): the running request stays, frozen; the cache cannot be
    flushed meanwhile (Scheduler.flush_cache); a version change while paused splits its tokens
    (utils/weight_versions.py: meta_info.weight_versions) and it finishes after the continue."""
    n = 3000 if backend.name == "sglang" else 600
    assert backend.call("/update_weight_version", {"new_version": "0"})[0] == 200
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(backend.call, "/generate", {
            "input_ids": [5, 6], "return_logprob": True,
            "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}, 120)
        _wait_running(backend)
        assert backend.call("/pause_generation", {"mode": "in_place"})[0] == 200
        try:
            flushed = backend.call("/flush_cache", {})[0]
            relabelled = backend.call("/update_weight_version", {"new_version": "9", "abort_all_requests": False})[0]
        finally:
            backend.call("/continue_generation", {})
        status, out = fut.result(120)
    backend.call("/update_weight_version", {"new_version": "0"})
    assert flushed == 400 and relabelled == 200
    meta = out["meta_info"]
    assert status == 200 and meta["finish_reason"]["type"] == "length", out
    spans = meta["weight_versions"]
    assert [sp["version"] for sp in spans] == ["0", "9"] and meta["weight_version"] == "9", spans
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0 and spans[1]["end"] == n
