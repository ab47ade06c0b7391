"""The GPU path's faults, caught on CPU by embedded servers as strict as SGLang.

Each test is one way a real SGLang server punishes a client that a forgiving stand-in
let pass (issue: "Real SGLang, strictly"); each failed on the client before it was fixed:

1. read-back is refused for the model class (Qwen2): verification by log-prob probe;
2. ``/health`` generates and fails while paused: liveness by a route that does not;
3. one weight-update session per push, closed whatever happens, a stale one recovered;
4. routes decide begin/end, not a parsed release (dev builds, old releases);
5. a refused update call cannot hang the broadcast (NCCL's first collective blocks);
6. (a server dying mid-push is test_server_faults', which runs strict servers too);
7. the launcher: ``--weight-version``, no GPU shared by a server and a trainer, no dp > 1;
8. SGLang's own router in front of two embedded servers.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import free_port, perturbed_weights, run_env
from test_publisher import Engine, SendsOther
from test_server_faults import Servers, _cfg, _client, _generate, _Weights
from test_server_faults import loop_runner  # noqa: F401 (a fixture)
from test_sglang_protocol import _request

from arealite.config.schema import ArealiteConfig
from arealite.weight_sync import DistributedTransfer, WeightPublisher, WeightSyncError, make_verifier

NO_READBACK = ()  # strict servers, SGLang's read-back list: the tiny Qwen2 cannot read back


@pytest.fixture(scope="module")
def base_state(micro_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(micro_model_dir, dtype=torch.float32).state_dict()


def _publisher(run, client, engine, transfer, n_tensors: int = 2) -> WeightPublisher:
    cfg = ArealiteConfig(weight_sync={"verify_n_tensors": n_tensors, "bucket_size_mb": 0.05, "timeout_s": 30})
    verifier = make_verifier(cfg, client.admin, transfer, engine, probe_prompt=[5, 6, 7, 8, 9, 10])
    pub = WeightPublisher(transfer, engine, client.admin, run, parties=[client, engine], verifier=verifier)
    pub.init()
    return pub


@pytest.fixture
def strict_pair(micro_model_dir, tmp_path, loop_runner):  # noqa: F811 - the imported fixture
    servers = Servers(micro_model_dir, tmp_path, 2, extra=NO_READBACK)
    client = _client(loop_runner, servers.addrs)
    yield servers, client
    servers.stop()
    loop_runner(client.aclose())


def test_unsupported_readback_is_verified_by_the_probe(strict_pair, loop_runner, base_state, micro_model_dir):
    """1: SGLang answers 400 for Qwen2's read-back; the push verifies by log-probs instead,
    and a push of the wrong weights is caught by the probe all the same."""
    run = loop_runner
    servers, client = strict_pair
    engine = Engine(perturbed_weights(base_state, 1), str(micro_model_dir))
    transfer = DistributedTransfer(_cfg(), client.admin, run)
    pub = _publisher(run, client, engine, transfer)
    try:
        out = pub.publish(1)
        assert out["probe_mean_abs_diff"] <= 1e-3 and "readback_tensors" not in out
        assert set(_generate(run, client).output_versions) == {1}
        bad = WeightPublisher(SendsOther(transfer, perturbed_weights(base_state, 9)), engine, client.admin, run,
                              parties=[client], verifier=pub.verifier)
        bad.init()
        with pytest.raises(WeightSyncError, match="log-prob probe mismatch") as err:
            bad.publish(2)
        assert err.value.server in servers.addrs and err.value.version == 2
    finally:
        run(client.continue_generation())
        pub.close()


def test_liveness_during_a_pause_does_not_generate(strict_pair, loop_runner):
    """2: paused, a strict server's /health cannot generate; the admin's probe must not drop it."""
    run = loop_runner
    servers, client = strict_pair
    run(client.admin.pause_generation())
    try:
        status, _ = _request(servers.addrs[0], "/health", timeout=30)
        assert status == 503
        assert run(client.admin.drop_unreachable(why="a test")) == []
        assert client.healthy_servers == servers.addrs
    finally:
        run(client.admin.continue_generation())


def test_servers_left_paused_mid_push_by_a_dead_trainer_do_not_block_the_next_run(
        strict_pair, loop_runner, base_state, micro_model_dir):
    """A trainer killed mid-push leaves its servers paused with a session open: the next
    run's client must start (its readiness probe does not generate) and its first push (at
    step 0 too) must bring them back with its own weights."""
    run = loop_runner
    servers, _ = strict_pair
    for addr in servers.addrs:
        assert _request(addr, "/pause_generation", {"mode": "abort"})[0] == 200
        assert _request(addr, "/begin_weight_update", {})[0] == 200
    fresh = _client(run, servers.addrs)
    engine = Engine(perturbed_weights(base_state, 7), str(micro_model_dir))
    pub = _publisher(run, fresh, engine, DistributedTransfer(_cfg(), fresh.admin, run))
    try:
        assert pub.publish(0)["probe_mean_abs_diff"] <= 1e-3
        assert set(_generate(run, fresh).output_versions) == {0}
    finally:
        pub.close()
        run(fresh.aclose())


class _BadShape:
    """A source whose second bucket holds a tensor of the wrong shape (the server refuses it)."""

    def __init__(self, state):
        self.state = state

    def named_weight_buckets(self, bucket_bytes):
        items = list(self.state.items())
        yield items[:3]
        name, t = items[3]
        yield [(name, torch.zeros(t.numel() + 1))]


def test_one_session_per_attempt_closed_on_failure_and_a_stale_one_recovered(
        strict_pair, loop_runner, base_state, micro_model_dir):
    """3: a failed push closes its session; a session left open by a dead trainer is closed
    and opened again instead of failing every later push."""
    run = loop_runner
    servers, client = strict_pair
    engine = Engine(perturbed_weights(base_state, 1), str(micro_model_dir))
    transfer = DistributedTransfer(_cfg(), client.admin, run)
    pub = _publisher(run, client, engine, transfer)
    try:
        # A session left open (as by a trainer killed mid-push): the push still goes through.
        assert _request(servers.addrs[0], "/begin_weight_update", {})[0] == 200
        assert pub.publish(1)["probe_mean_abs_diff"] <= 1e-3
        for addr in servers.addrs:  # and it closed the session it opened
            assert _request(addr, "/end_weight_update", {})[0] == 400
        # A push that fails mid-way closes its session too.
        failing = WeightPublisher(DistributedTransfer(_cfg(), client.admin, run), _Weights(_BadShape(base_state)),
                                  client.admin, run, parties=[client])
        failing.init()
        with pytest.raises(WeightSyncError):
            failing.publish(2)
        for addr in servers.addrs:
            assert _request(addr, "/begin_weight_update", {})[0] == 200, "the failed push left a session open"
            assert _request(addr, "/end_weight_update", {})[0] == 200
        failing.close()
    finally:
        run(client.admin.continue_generation())
        pub.close()


def test_routes_not_the_release_decide_begin_and_end(micro_model_dir, tmp_path, loop_runner, base_state):
    """4: a build from source reports 0.0.0.dev0 but has (and requires) sessions; a 0.5.20 has
    none. The client asks the routes (/openapi.json), and a push reaches both."""
    run = loop_runner
    servers = Servers(micro_model_dir, tmp_path, 2, extra=[("--sglang-version", "0.0.0.dev0"),
                                                            ("--sglang-version", "0.5.20")])
    client = _client(run, servers.addrs)
    engine = Engine(perturbed_weights(base_state, 3), str(micro_model_dir))
    pub = _publisher(run, client, engine, DistributedTransfer(_cfg(), client.admin, run))
    try:
        dev, old = servers.addrs
        assert client.admin.supports_weight_update_brackets(dev)
        assert not client.admin.supports_weight_update_brackets(old)
        assert _request(old, "/begin_weight_update", {})[0] == 404
        assert pub.publish(1)["probe_mean_abs_diff"] <= 1e-3
        assert set(_generate(run, client).output_versions) == {1}
    finally:
        pub.close()
        servers.stop()
        run(client.aclose())


class _FirstCollectiveBlocks:
    """The trainer's end of a group whose first collective blocks until every rank joins, as
    NCCL's does (communicator set-up), and one rank never will."""

    def __init__(self, group):
        self.inner, self.device, self.released = group, group.device, threading.Event()

    def broadcast(self, tensors):
        self.released.wait(120)
        raise RuntimeError("the first collective never completed")

    def close(self):
        self.released.set()
        self.inner.close()


class _SkipsBegin:
    """An admin that forgets to open the session: the server refuses the update call before
    receiving anything (SGLang's scheduler does)."""

    def __init__(self, admin):
        self._admin = admin

    def __getattr__(self, name):
        return getattr(self._admin, name)

    async def begin_weight_update(self):
        return {}


def test_a_refused_update_call_cannot_hang_the_first_collective(strict_pair, loop_runner, base_state):
    """5: the HTTP refusal ends the wait within moments (not weight_sync.timeout_s), names the
    server, and tears the group down."""
    run = loop_runner
    servers, client = strict_pair
    transfer = DistributedTransfer(_cfg(timeout_s=60), _SkipsBegin(client.admin), run)
    transfer.init()
    transfer.group = _FirstCollectiveBlocks(transfer.group)
    run(client.admin.pause_generation())
    t0 = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match="begin_weight_update") as err:
            transfer.transfer(_Weights(_as_source(base_state)), 1)
        assert time.monotonic() - t0 < 20
        assert err.value.server in servers.addrs
        assert transfer.group is None, "the group is torn down"
    finally:
        run(client.admin.continue_generation())
        transfer.close()


def _as_source(state):
    from arealite.weight_sync import StateDictSource

    return StateDictSource(state)


# ------------------------------------------------------------------ 7: the launcher


def test_sglang_command_starts_at_the_run_version_and_refuses_data_parallelism(tmp_path):
    from arealite.server.command_line import embedded_server_command, sglang_server_command

    cfg = ArealiteConfig(actor={"model_path": str(tmp_path)}, launch={"server_backend": "sglang"})
    cmd = sglang_server_command(cfg, 30000, 0, weight_version=12)
    assert cmd[cmd.index("--weight-version") + 1] == "12"
    cmd = embedded_server_command(cfg, 30000, 0, weight_version=3)
    assert cmd[cmd.index("--weight-version") + 1] == "3"
    for extra in (["--dp-size", "2"], ["--dp=4"], ["--data-parallel-size", "2"]):
        with pytest.raises(ValueError, match="launch.n_servers"):
            ArealiteConfig(server={"sglang": {"extra_args": extra}})
    ArealiteConfig(server={"sglang": {"extra_args": ["--dp-size", "1"]}})


def test_launcher_starts_servers_at_the_resumed_version_and_never_shares_a_gpu(tmp_path, monkeypatch):
    from arealite.launcher import local

    cfg = ArealiteConfig(actor={"model_path": str(tmp_path)}, experiment={"output_root": str(tmp_path)},
                         launch={"server_backend": "sglang", "n_servers": 2, "n_trainer_procs": 1})
    launcher = local.LocalLauncher.__new__(local.LocalLauncher)
    launcher.cfg = cfg
    assert launcher.start_version() == 0
    ckpt = tmp_path / cfg.experiment.name / cfg.experiment.trial / "checkpoints" / "step_7"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text('{"files": []}')
    assert launcher.start_version() == 7
    monkeypatch.setattr(local, "_cuda_device_count", lambda: 2)
    with pytest.raises(SystemExit, match="launch.n_trainer_procs"):
        launcher._gpu_plan()
    monkeypatch.setattr(local, "_cuda_device_count", lambda: 3)
    assert launcher._gpu_plan() == (["0", "1"], "2")


# ------------------------------------------------------------------ 8: SGLang's router


@pytest.mark.slow
def test_sglang_router_in_front_of_two_embedded_servers(micro_model_dir, tmp_path, loop_runner):
    """SGLang's router (sglang-router, a test extra) forwards /generate to strict embedded
    servers: single and batch requests with log-probs, round-robin reaching both."""
    pytest.importorskip("sglang_router")
    servers = Servers(micro_model_dir, tmp_path, 2, extra=NO_READBACK)
    port, metrics = free_port(), free_port()
    log = open(tmp_path / "router.log", "wb")
    router = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
         "--policy", "round_robin", "--prometheus-port", str(metrics),
         "--worker-urls", *[f"http://{a}" for a in servers.addrs]],
        stdout=log, stderr=subprocess.STDOUT, env=run_env(), start_new_session=True)
    addr = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if _request(addr, "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}},
                            timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            assert router.poll() is None and time.monotonic() < deadline, (tmp_path / "router.log").read_text()
            time.sleep(0.5)
        before = [_generated(a) for a in servers.addrs]
        for _ in range(4):
            status, out = _request(addr, "/generate", {"input_ids": [5, 6, 7], "return_logprob": True,
                                                       "sampling_params": {"max_new_tokens": 3}})
            assert status == 200, out
            assert [e[1] for e in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
        status, outs = _request(addr, "/generate", {"input_ids": [[5, 6], [7, 8, 9]], "return_logprob": True,
                                                    "sampling_params": {"max_new_tokens": 2}})
        assert status == 200 and len(outs) == 2, outs
        assert all(len(o["meta_info"]["output_token_logprobs"]) == 2 for o in outs)
        after = [_generated(a) for a in servers.addrs]
        assert all(b > a for a, b in zip(before, after)), "round-robin reaches both servers"
    finally:
        router.terminate()
        try:
            router.wait(10)
        except subprocess.TimeoutExpired:
            router.kill()
        servers.stop()


def _generated(addr: str) -> int:
    return _request(addr, "/server_info")[1]["internal_states"][0]["generated_tokens"]
