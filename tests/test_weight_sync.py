"""Weight sync against a real embedded server subprocess (micro tiny model).

The test process plays trainer rank 0: it hosts the TCP store, builds the gloo
group, broadcasts, and drives the server through the real client on an event
loop running in a background thread (as the rollout controller does). Every update
goes through `WeightPublisher.publish` (pause, transfer, verify, version, continue).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import perturbed_weights

from arealite.api.types import GenerationRequest, SamplingParams
from arealite.config.schema import WeightSyncConfig
from arealite.inference_client.sglang_client import SGLangClient
from arealite.utils.net import free_port
from arealite.weight_sync import (
    DiskTransfer,
    DistributedTransfer,
    ReadbackVerifier,
    ShmTransfer,
    StateDictSource,
    WeightPublisher,
    WeightSyncError,
    compare_readback,
)
from arealite.weight_sync.base import VERIFY_TRUNCATE, buckets_of


def _start_server(model_dir: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "arealite.server", "--model-path", str(model_dir),
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    addr = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://{addr}/health", timeout=1) as r:
                if r.status == 200:
                    return proc, addr
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server not healthy: {log_path.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def loop_runner():
    """An event loop in a thread and `run(coro)`, like RolloutController.run."""
    import uvloop

    loop = uvloop.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    yield run, loop
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)


@pytest.fixture(scope="module")
def server(micro_model_dir, tmp_path_factory):
    proc, addr = _start_server(micro_model_dir, tmp_path_factory.mktemp("ws") / "server.log")
    yield addr
    _stop(proc)


@pytest.fixture(scope="module")
def client(server, loop_runner):
    run, _ = loop_runner
    c = SGLangClient([server])
    run(c.initialize(30))
    yield c
    run(c.aclose())


def _server_tensor(run, client, name: str, n: int = 100_000) -> torch.Tensor:
    (values,) = run(client.get_weights_by_name(name, n)).values()
    return torch.tensor(values, dtype=torch.float32).flatten()


def _assert_server_has(run, client, state: dict[str, torch.Tensor]) -> None:
    for name, t in state.items():
        got = _server_tensor(run, client, name)
        assert torch.equal(got, t.flatten().float()), f"{name} differs on the server"


def _generate_version(run, client) -> list[int]:
    req = GenerationRequest(input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=4, greedy=True))
    return list(run(client.agenerate(req)).output_versions)


def _cfg(**kw) -> WeightSyncConfig:
    return WeightSyncConfig(**{"bucket_size_mb": 0.05, "verify_n_tensors": 3, "timeout_s": 30, **kw})


class Weights:
    """The trainer's weights as a `WeightSource`; a test swaps them between updates."""

    def __init__(self, state):
        self.set(state)

    def set(self, source_or_state) -> "Weights":
        self.src = source_or_state if hasattr(source_or_state, "named_weight_buckets") \
            else StateDictSource(source_or_state)
        return self

    def named_weight_buckets(self, bucket_bytes):
        return self.src.named_weight_buckets(bucket_bytes)


def _publisher(transfer, client, run, weights: Weights) -> WeightPublisher:
    """A publisher over `client` (the client is the party that learns the version)."""
    verifier = ReadbackVerifier(client.admin, transfer.config.verify_n_tensors,
                                dtype=lambda: transfer.server_dtype)
    pub = WeightPublisher(transfer, weights, client.admin, run, parties=[client], verifier=verifier)
    pub.init()
    return pub


def _served_client(model_dir: Path, log_path: Path, loop_runner):
    """A client of a real server of ``model_dir`` (a generator for a module fixture to yield from)."""
    proc, addr = _start_server(model_dir, log_path)
    run, _ = loop_runner
    c = SGLangClient([addr])
    run(c.initialize(30))
    yield c
    run(c.aclose())
    _stop(proc)


def _trained_engine(model_dir: Path, batch: dict[str, torch.Tensor]):
    """An FSDP engine of ``model_dir`` after one step on ``batch`` (its weights now differ from
    the file) and the tensors it pushes (a generator for a module fixture to yield from)."""
    from arealite.config.schema import ActorConfig
    from arealite.train_engine.fsdp import FSDPEngine

    engine = FSDPEngine(ActorConfig(model_path=str(model_dir)), device="cpu").initialize()
    engine.train_batch(batch, lambda head, mb: -head.logprobs(mb["labels"]).mean(), lambda mb: 1.0)
    pushed = {n: t.clone() for b in engine.named_weight_buckets(1 << 14) for n, t in b}
    yield engine, pushed
    engine.destroy()


def _push_and_read_back(method: str, engine, pushed: dict[str, torch.Tensor], client, run, model_dir: Path,
                        tmp_path: Path) -> None:
    """Publish ``engine``'s weights to ``client``'s server by ``method`` (distributed, disk, shm,
    shm_alias), then read every pushed tensor back from the server."""
    cfg = _cfg(verify_n_tensors=4, shm_dir=str(tmp_path), shm_alias=method == "shm_alias")
    if method == "distributed":
        transfer = DistributedTransfer(cfg, client.admin, run)
    elif method == "disk":
        transfer = DiskTransfer(cfg, client.admin, run, tmp_path / "scratch", str(model_dir))
    else:
        transfer = ShmTransfer(cfg, client.admin, run)
    pub = _publisher(transfer, client, run, Weights(engine))
    try:
        pub.publish(1)
        _assert_server_has(run, client, pushed)
    finally:
        pub.close()


def test_distributed_publish_in_buckets_updates_weights_and_version(client, loop_runner, base_state):
    run, _ = loop_runner
    weights = Weights(base_state)
    pub = _publisher(DistributedTransfer(_cfg(), client.admin, run), client, run, weights)
    try:
        for version, seed in ((1, 1), (2, 2)):  # the group serves more than one update
            new = perturbed_weights(base_state, seed)
            weights.set(new)
            timings = pub.publish(version)
            assert timings["n_buckets"] > 1, "the micro model should need several 50 KB buckets"
            assert timings["n_tensors"] == len(StateDictSource(new).tensors)
            assert timings["total_s"] >= timings["transfer_s"] > 0
            assert {"pause_s", "verify_s", "continue_s"} <= set(timings)
            _assert_server_has(run, client, new)
            assert client.get_version() == version
            assert set(_generate_version(run, client)) == {version}
    finally:
        pub.close()


def test_disk_publish_updates_weights_and_removes_the_directory(client, loop_runner, base_state, tmp_path,
                                                                micro_model_dir):
    run, _ = loop_runner
    root = tmp_path / "scratch"
    new = perturbed_weights(base_state, 3)
    transfer = DiskTransfer(_cfg(bucket_size_mb=0.03), client.admin, run, root, str(micro_model_dir))
    pub = _publisher(transfer, client, run, Weights(new))
    timings = pub.publish(7)
    assert timings["load_s"] > 0 and timings["write_s"] > 0 and timings["bytes"] > 0
    _assert_server_has(run, client, new)
    assert set(_generate_version(run, client)) == {7}
    assert root.is_dir() and list(root.iterdir()) == [], "the update's directory must be deleted"
    pub.close()
    assert not root.exists()


class _CorruptSource:
    """Yields one tensor with the wrong shape or dtype (an engine bug)."""

    def __init__(self, state, how: str):
        self.tensors = StateDictSource(state).tensors
        self.how = how
        self.victim = next(n for n, t in self.tensors if t.dim() == 2 and t.shape[0] != t.shape[1])

    def named_weight_buckets(self, bucket_bytes):
        def bad(n, t):
            if n != self.victim:
                return t
            return t.t().contiguous() if self.how == "shape" else t.to(torch.float64)

        yield from buckets_of([(n, bad(n, t)) for n, t in self.tensors], bucket_bytes)


@pytest.mark.parametrize("how", ["shape", "dtype"])
def test_corrupted_update_fails_loudly_and_server_stays_paused(client, loop_runner, base_state, server, how):
    run, loop = loop_runner
    before = {n: _server_tensor(run, client, n) for n in base_state if n != "lm_head.weight"}
    version_before = _generate_version(run, client)[0]
    src = _CorruptSource(perturbed_weights(base_state, 11), how)
    weights = Weights(src)
    pub = _publisher(DistributedTransfer(_cfg(), client.admin, run), client, run, weights)
    with pytest.raises(WeightSyncError) as err:
        pub.publish(99)
    msg = str(err.value)
    assert server in msg and src.victim in msg and "99" in msg
    assert err.value.server == server and err.value.tensor == src.victim
    # Not serving silently: the server is still paused, a generation does not finish.
    req = GenerationRequest(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2, greedy=True))
    fut = asyncio.run_coroutine_threadsafe(client.agenerate(req), loop)
    time.sleep(1.0)
    assert not fut.done(), "a server whose update failed must not serve"
    # The bucket that held the bad tensor was refused as a whole.
    bad_bucket = next(b for b in src.named_weight_buckets(50 * 1024) if src.victim in dict(b))
    for name, _ in bad_bucket:
        if name in before:
            assert torch.equal(_server_tensor(run, client, name), before[name])
    assert client.get_version() != 99, "a failed update sets no version"
    # A further update through the broken group is refused at once.
    weights.set(base_state)
    with pytest.raises(WeightSyncError, match="broken"):
        pub.publish(100)
    # The failed attempt closed its weight-update session (SGLang would refuse the next
    # begin otherwise): a new one opens. The server stays paused until continued.
    run(client.begin_weight_update())
    run(client.end_weight_update())
    run(client.continue_generation())
    assert fut.result(30).output_versions[0] == version_before
    pub.close()


def test_readback_mismatch_names_server_and_tensor(client, loop_runner, base_state):
    run, _ = loop_runner
    new = perturbed_weights(base_state, 5)
    pub = _publisher(DistributedTransfer(_cfg(verify_n_tensors=1), client.admin, run), client, run,
                     Weights(new))
    pub.publish(5)
    name = "model.layers.0.mlp.up_proj.weight"
    wrong = {name: new[name][:100].flatten().clone()}
    wrong[name][17] += 0.5
    answers = {name: run(client.get_weights_by_name(name, VERIFY_TRUNCATE))}
    with pytest.raises(WeightSyncError, match="read-back mismatch") as err:
        compare_readback(wrong, answers, 5)
    assert err.value.tensor == name and err.value.server == client.servers[0]
    pub.close()


def test_inflight_rollout_is_interrupted_and_resumes_onperturbed_weights(client, loop_runner, base_state):
    run, loop = loop_runner
    pub = _publisher(DistributedTransfer(_cfg(bucket_size_mb=1.0), client.admin, run), client, run,
                     Weights(perturbed_weights(base_state, 6)))
    before = _generate_version(run, client)[0]
    req = GenerationRequest(input_ids=[3, 4, 5],
                            sampling=SamplingParams(max_new_tokens=900, ignore_eos=True))
    fut = asyncio.run_coroutine_threadsafe(client.agenerate(req), loop)
    time.sleep(0.3)  # let it produce some tokens
    assert not fut.done()
    pub.publish(before + 1)
    out = fut.result(120)
    assert len(out.output_ids) == 900
    versions = list(out.output_versions)
    assert versions[0] == before and versions[-1] == before + 1
    assert versions == sorted(versions), "each token keeps the version that produced it"
    assert out.n_interruptions >= 1
    pub.close()


def test_a_dead_server_stops_the_update_with_its_name(micro_model_dir, loop_runner, base_state, tmp_path):
    run, _ = loop_runner
    proc, addr = _start_server(micro_model_dir, tmp_path / "doomed.log")
    c = SGLangClient([addr])
    try:
        run(c.initialize(30))
        pub = _publisher(DistributedTransfer(_cfg(timeout_s=20), c.admin, run), c, run, Weights(base_state))
        _stop(proc)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError) as err:
            pub.publish(1)
        assert addr in str(err.value)
        assert time.monotonic() - t0 < 15, "a dead server must fail fast, not at the timeout"
    finally:
        _stop(proc)
        run(c.aclose())


def test_make_transfer_follows_the_config(tmp_path):
    from arealite.config.schema import ArealiteConfig
    from arealite.weight_sync import make_transfer, server_weight_dtype

    admin = SGLangClient(["127.0.0.1:1"]).admin
    cfg = ArealiteConfig.model_validate({
        "experiment": {"output_root": str(tmp_path), "name": "e", "trial": "t"},
        "weight_sync": {"method": "disk"}})
    transfer = make_transfer(cfg, admin, run=None)
    assert isinstance(transfer, DiskTransfer) and transfer.root == tmp_path / "e" / "t" / "weight_sync"
    assert server_weight_dtype(cfg) is None  # embedded on CPU keeps the checkpoint's dtype
    cfg.weight_sync.method = "distributed"
    cfg.server.dtype = "bfloat16"
    transfer = make_transfer(cfg, admin, run=None)
    assert isinstance(transfer, DistributedTransfer) and transfer.wire_dtype == torch.bfloat16
    assert transfer.backend == ("nccl" if torch.cuda.is_available() else "gloo")
    cfg.server.dtype = "auto"
    cfg.launch.server_backend = "sglang"
    assert server_weight_dtype(cfg) == torch.bfloat16
    assert make_transfer(cfg, admin, None).layout == "sglang"
    with pytest.raises(TypeError, match="does not implement DistributedUpdateAdmin"):
        make_transfer(cfg, object(), None)
