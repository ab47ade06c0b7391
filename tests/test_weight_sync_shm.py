"""The shared-memory weight transfer against a real embedded server subprocess (micro tiny model).

The test process plays trainer rank 0 and drives the server (started with an API
key) through the real client on an event loop in a background thread; every update
goes through `WeightPublisher.publish`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch
from conftest import perturbed_weights

from arealite.api.types import GenerationRequest, SamplingParams
from arealite.config.cross_field_checks import check_config
from arealite.config.launch_checks import check_launch
from arealite.config.loader import ConfigError
from arealite.config.schema import ArealiteConfig, WeightSyncConfig
from arealite.inference_client.sglang_client import SGLangClient
from arealite.utils.net import free_port
from arealite.weight_sync import (
    ReadbackVerifier,
    ShmTransfer,
    StateDictSource,
    WeightPublisher,
    WeightSyncError,
    make_transfer,
)

KEY = "shm-test-key"


@pytest.fixture(scope="module")
def loop_runner():
    import uvloop

    loop = uvloop.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    yield run
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)


@pytest.fixture(scope="module")
def server(micro_model_dir, tmp_path_factory):
    """An embedded server requiring the API key `KEY`."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("shm") / "server.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "arealite.server", "--model-path", str(micro_model_dir),
         "--host", "127.0.0.1", "--port", str(port), "--api-key", KEY],
        stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
        env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    addr = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://{addr}/health", timeout=1):
                    break
            except OSError:
                time.sleep(0.2)
        yield addr
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def client(server, loop_runner):
    c = SGLangClient([server], api_key=KEY)
    loop_runner(c.initialize(30))
    yield c
    loop_runner(c.aclose())


@pytest.fixture
def shm_dir():
    """A fresh directory on tmpfs (as in real use), removed afterwards."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    d = root / f"arealite-test-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _cfg(**kw) -> WeightSyncConfig:
    """Copy mode unless asked (one file the server copies out of); alias mode has its own test."""
    return WeightSyncConfig(**{"bucket_size_mb": 0.05, "verify_n_tensors": 3, "timeout_s": 30,
                               "shm_alias": False, **kw})


class Weights:
    """The trainer's weights as a `WeightSource`; a test swaps them between updates."""

    def __init__(self, state_or_source=None):
        self.src = None
        if state_or_source is not None:
            self.set(state_or_source)

    def set(self, state_or_source) -> None:
        self.src = state_or_source if hasattr(state_or_source, "named_weight_buckets") \
            else StateDictSource(state_or_source)

    def named_weight_buckets(self, bucket_bytes):
        return self.src.named_weight_buckets(bucket_bytes)


def _publisher(transfer: ShmTransfer, client, run, weights: Weights) -> WeightPublisher:
    verifier = ReadbackVerifier(client.admin, transfer.config.verify_n_tensors,
                                dtype=lambda: transfer.server_dtype)
    pub = WeightPublisher(transfer, weights, client.admin, run, parties=[client], verifier=verifier)
    pub.init()
    return pub


def _post(addr: str, route: str, body: dict, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(f"http://{addr}{route}", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _server_tensor(addr: str, name: str) -> torch.Tensor:
    status, values = _post(addr, "/get_weights_by_name", {"name": name, "truncate_size": 10**6})
    assert status == 200, values
    return torch.tensor(values, dtype=torch.float32).flatten()


def _greedy(run, client, prompt: list[int], n: int = 8) -> tuple[list[int], set[int]]:
    req = GenerationRequest(input_ids=prompt, sampling=SamplingParams(max_new_tokens=n, greedy=True,
                                                                      ignore_eos=True))
    out = run(client.agenerate(req))
    return list(out.output_ids), set(out.output_versions)


def _hf_argmax_agrees(model_dir: Path, state: dict, prompt: list[int], output: list[int]) -> bool:
    """Whether `output` is the greedy continuation of `prompt` under `state` (teacher-forced)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    return logits[len(prompt) - 1:-1].argmax(-1).tolist() == output


def test_publish_gives_the_server_the_trainers_weights_and_reuses_one_file(
        client, loop_runner, server, base_state, shm_dir, micro_model_dir):
    run = loop_runner
    prompt = [5, 6, 7, 8]
    before, _ = _greedy(run, client, prompt)
    sync = ShmTransfer(_cfg(shm_dir=str(shm_dir)), client.admin, run)
    weights = Weights()
    pub = _publisher(sync, client, run, weights)
    assert sync.server_dtype == torch.float32  # learnt from the server
    try:
        new = perturbed_weights(base_state, 1)
        weights.set(new)
        timings = pub.publish(1)
        path = sync.path
        assert path is not None and path.parent == shm_dir and path.is_file()
        assert list(shm_dir.iterdir()) == [path], "one file, nothing else"
        assert timings["recreated"] == 1 and timings["bytes"] > 0 and timings["load_s"] > 0
        assert timings["n_tensors"] == len(StateDictSource(new).tensors)
        for name, t in new.items():  # every tensor, tied lm_head included
            assert torch.equal(_server_tensor(server, name), t.flatten()), name
        after, versions = _greedy(run, client, prompt)
        assert versions == {1}
        assert after != before, "new weights must change the greedy continuation"
        assert _hf_argmax_agrees(micro_model_dir, new, prompt, after)

        inode = path.stat().st_ino
        newer = perturbed_weights(base_state, 2)
        weights.set(newer)
        timings = pub.publish(2)
        assert sync.path == path and path.stat().st_ino == inode and timings["recreated"] == 0
        for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
            assert torch.equal(_server_tensor(server, name), newer[name].flatten()), name
        assert _greedy(run, client, prompt)[1] == {2}
        status, info = _post(server, "/get_model_info", {})
        assert status == 200 and info["weight_version"] == "2"
    finally:
        pub.close()
    assert sync.path is None and list(shm_dir.iterdir()) == [], "close() must delete the file"
    pub.close()  # twice is fine


def test_alias_mode_serves_out_of_two_files_in_turn_and_a_copy_update_still_works(
        client, loop_runner, server, base_state, shm_dir, micro_model_dir, tmp_path):
    """With shm_alias the server's parameters point into the trainer's files: each update
    writes the file the server does not serve from, then switches; a later update that
    copies (from disk) gives the server its own storage back first."""
    run = loop_runner
    prompt = [5, 6, 7, 8]
    sync = ShmTransfer(_cfg(shm_dir=str(shm_dir), shm_alias=True), client.admin, run)
    weights = Weights()
    pub = _publisher(sync, client, run, weights)
    try:
        paths = []
        for version in (1, 2, 3):
            new = perturbed_weights(base_state, 10 + version)
            weights.set(new)
            pub.publish(version)
            paths.append(sync.path)
            for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.up_proj.weight",
                         "model.norm.weight"):
                src = new["model.embed_tokens.weight" if name == "lm_head.weight" else name]
                assert torch.equal(_server_tensor(server, name), src.flatten()), (version, name)
            out, versions = _greedy(run, client, prompt)
            assert versions == {version} and _hf_argmax_agrees(micro_model_dir, new, prompt, out)
        assert paths[0] == paths[2] != paths[1], "two files, written in turn"
        assert sorted(shm_dir.iterdir()) == sorted(set(paths))
        # Rewriting the file the server does not serve from leaves its weights alone.
        served = _server_tensor(server, "model.norm.weight")
        weights.set(perturbed_weights(base_state, 99))
        sync.stage(weights, 4)
        assert torch.equal(_server_tensor(server, "model.norm.weight"), served)
        sync._staged = None  # (the test stops this update here)
        # A copy-based update (from disk) after aliasing: the server owns its weights again.
        from arealite.weight_sync import DiskTransfer

        disk = DiskTransfer(_cfg(), client.admin, run, tmp_path / "wsync", str(micro_model_dir))
        final = perturbed_weights(base_state, 5)
        weights.set(final)
        disk_pub = _publisher(disk, client, run, weights)
        disk_pub.publish(5)
        assert torch.equal(_server_tensor(server, "model.norm.weight"), final["model.norm.weight"].flatten())
        sync.close()
        assert list(shm_dir.iterdir()) == [], "close() deletes both files"
        assert _greedy(run, client, prompt)[1] == {5}, "the server still generates once the files are gone"
        disk_pub.close()
    finally:
        pub.close()


class _Reordered:
    """The same tensors in reverse order: same names, another layout."""

    def __init__(self, state):
        self.tensors = list(reversed(StateDictSource(state).tensors))

    def named_weight_buckets(self, bucket_bytes):
        yield self.tensors


def test_a_changed_layout_recreates_the_file(client, loop_runner, server, base_state, shm_dir):
    sync = ShmTransfer(_cfg(shm_dir=str(shm_dir)), client.admin, loop_runner)
    weights = Weights(perturbed_weights(base_state, 3))
    pub = _publisher(sync, client, loop_runner, weights)
    try:
        pub.publish(3)
        first = sync.path
        new = perturbed_weights(base_state, 4)
        weights.set(_Reordered(new))
        timings = pub.publish(4)
        assert timings["recreated"] == 1 and sync.path != first and not first.exists()
        assert list(shm_dir.iterdir()) == [sync.path]
        for name in ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"):
            assert torch.equal(_server_tensor(server, name), new[name].flatten()), name
    finally:
        pub.close()


def test_a_refused_update_raises_and_leaves_the_servers_paused(client, loop_runner, server, base_state,
                                                               shm_dir):
    run = loop_runner
    # bfloat16 slots for a float32 server: the server refuses, naming the dtype.
    sync = ShmTransfer(_cfg(shm_dir=str(shm_dir)), client.admin, run, server_dtype=torch.bfloat16)
    pub = _publisher(sync, client, run, Weights(perturbed_weights(base_state, 5)))
    before = _server_tensor(server, "model.norm.weight")
    version_before = client.get_version()
    try:
        with pytest.raises(WeightSyncError) as err:
            pub.publish(5)
        assert "dtype" in str(err.value) and server in str(err.value)
        assert client.get_version() == version_before, "a failed update sets no version"
        status, info = _post(server, "/get_server_info", {})
        assert info["internal_states"][0]["paused"] is True
        assert torch.equal(_server_tensor(server, "model.norm.weight"), before), "no half-applied update"
    finally:
        pub.close()
        run(client.continue_generation())


def _good_request(state: dict, path: Path) -> dict:
    """A valid request for `state`'s tensors written to `path`."""
    tensors = StateDictSource(state).tensors
    offsets, pos, blob = [], 0, bytearray()
    for _, t in tensors:
        raw = t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        offsets.append(pos)
        blob += raw + b"\0" * (-len(raw) % 64)
        pos = len(blob)
    path.write_bytes(bytes(blob))
    return {"path": str(path), "names": [n for n, _ in tensors],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors], "offsets": offsets, "weight_version": "77"}


def _with(req: dict, field: str, i: int, value) -> dict:
    out = {k: (list(v) if isinstance(v, list) else v) for k, v in req.items()}
    out[field][i] = value
    return out


def test_bad_requests_get_400_naming_the_problem(server, base_state, shm_dir):
    new = perturbed_weights(base_state, 6)
    good = _good_request(new, shm_dir / "w.bin")
    names = good["names"]
    i = names.index("model.layers.0.self_attn.q_proj.weight")
    size = (shm_dir / "w.bin").stat().st_size
    partial = {k: (v[1:] if isinstance(v, list) else v) for k, v in good.items()}
    cases = [
        (_with(good, "names", i, "model.nope.weight"), "'model.nope.weight' is not a weight"),
        (_with(good, "dtypes", i, "bfloat16"), "dtype torch.bfloat16 does not match"),
        (_with(good, "dtypes", i, "float33"), "dtypes[%d]" % i),
        (_with(good, "shapes", i, [1, 2]), "shape [1, 2] does not match"),
        (_with(good, "offsets", i, size - 4), "runs past the end of the file"),
        (_with(good, "offsets", i, good["offsets"][i] + 2), "not a multiple of its element size"),
        (_with(good, "offsets", i, -1), "offsets[%d] must be a non-negative int" % i),
        ({**good, "path": str(shm_dir / "missing.bin")}, "cannot be opened"),
        ({**good, "path": str(shm_dir)}, "not a regular file"),
        (partial, f"names lack tensor {names[0]!r}"),
        ({**good, "offsets": good["offsets"][:-1]}, "equal length"),
        ({k: v for k, v in good.items() if k != "offsets"}, "missing field(s) ['offsets']"),
        ({**good, "extra": 1}, "unknown field(s) ['extra']"),
    ]
    before = _server_tensor(server, names[i])
    for body, needle in cases:
        status, out = _post(server, "/update_weights_from_shm", body)
        message = out.get("message") or out.get("error", {}).get("message", "")
        assert status == 400 and needle in message, (needle, status, out)
    assert torch.equal(_server_tensor(server, names[i]), before), "a refused update changed the weights"

    status, out = _post(server, "/update_weights_from_shm", good, key=None)
    assert status == 401 and "unauthorized" in out["error"]["message"]
    status, out = _post(server, "/update_weights_from_shm", good, key="wrong")
    assert status == 401
    assert torch.equal(_server_tensor(server, names[i]), before)

    # The file rewritten in place (same mapping) is read afresh by the next update.
    status, out = _post(server, "/update_weights_from_shm", good)
    assert status == 200 and out["success"], out
    assert torch.equal(_server_tensor(server, names[i]), new[names[i]].flatten())
    newer = perturbed_weights(base_state, 7)
    _good_request(newer, shm_dir / "w.bin")
    status, out = _post(server, "/update_weights_from_shm", {**good, "weight_version": "78"})
    assert status == 200, out
    assert torch.equal(_server_tensor(server, names[i]), newer[names[i]].flatten())
    assert _post(server, "/get_model_info", {})[1]["weight_version"] == "78"


def test_init_refuses_servers_on_another_host(shm_dir):
    c = SGLangClient(["10.255.255.1:30000"])
    sync = ShmTransfer(_cfg(shm_dir=str(shm_dir)), c.admin, run=None)
    with pytest.raises(WeightSyncError, match=r"weight_sync.method=shm needs every server on this host"):
        sync.init()
    bad_dir = ShmTransfer(_cfg(shm_dir=str(shm_dir / "nope")), c.admin, run=None)
    with pytest.raises(WeightSyncError, match="weight_sync.shm_dir"):
        bad_dir.init()


@pytest.mark.parametrize("devices,alias", [(("cpu", "cpu"), True), (("cpu", "cuda:0"), False)])
def test_alias_gives_way_to_copies_when_a_server_runs_on_a_gpu(shm_dir, devices, alias):
    # Found on an H200: a CUDA embedded server refuses alias (400), which stopped the run at
    # its first push; such a server copies into device memory anyway.
    addrs = ["127.0.0.1:1", "127.0.0.1:2"]
    c = SGLangClient(addrs)
    for addr, dev in zip(addrs, devices):
        c.pool.get(addr).info = {"engine": "arealite-embedded", "device": dev, "dtype": "float32"}
    sync = ShmTransfer(_cfg(shm_dir=str(shm_dir), shm_alias=True), c.admin, run=None)
    sync.init()
    assert sync.alias is alias and len(sync._slots) == (2 if alias else 1)
    assert sync.server_dtype == torch.float32


def test_config_accepts_shm_only_for_embedded_servers_on_this_host(tmp_path):
    cfg = ArealiteConfig.model_validate({"weight_sync": {"method": "shm", "shm_dir": "/dev/shm"}})
    check_config(cfg, check_paths=False)
    sync = make_transfer(cfg, SGLangClient(["127.0.0.1:1"]).admin, run=None)
    assert isinstance(sync, ShmTransfer) and sync.shm_dir == Path("/dev/shm")

    cfg.launch.server_backend = "sglang"
    with pytest.raises(ConfigError) as err:
        check_config(cfg, check_paths=False)
    text = str(err.value)
    assert "weight_sync.method" in text and "sglang" in text and "distributed" in text

    cfg.launch.server_backend = "embedded"
    cfg.launch.n_servers = 0
    cfg.launch.server_addrs = ["127.0.0.1:30000", "localhost:30001"]
    assert check_launch(cfg, environ={}) == ["127.0.0.1:30000", "localhost:30001"]
    cfg.launch.server_addrs = ["127.0.0.1:30000", "10.255.255.1:30000"]
    with pytest.raises(ConfigError) as err:
        check_launch(cfg, environ={})
    text = str(err.value)
    assert "weight_sync.method" in text and "10.255.255.1:30000" in text and "distributed" in text
