"""SGLang 0.5.21, read once more: the faults a real GPU run could still hit (issue 32).

Each test failed on the code before its fix:

1. readiness was declared on ``/get_model_info``, before SGLang's start-up warm-up: a push
   at start-up paused the server before its warm-up request, which then timed out and
   killed the server (the strict stand-in models the warm-up and its timeout);
2. ``weight_version`` went with every bucket of a distributed push, and SGLang relabels
   per call: a push failing in its middle bucket left servers labelled with the new version;
3. pipeline-parallel flags in ``server.sglang.extra_args`` were not refused;
4. ``actor.lora.target_modules`` was not held to SGLang's ``--lora-target-modules`` list;
5. docs/sglang.md cited a request class 0.5.21 does not have, said ``/health`` is the
   start-up probe, and left routes without their source file;
6. float token ids were truncated by the inference client and answered.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import free_port, perturbed_weights, run_env
from test_client import FakeSGLang
from test_publisher import Engine
from test_server_faults import Servers, _cfg, _client, _generate, _Weights
from test_server_faults import loop_runner  # noqa: F401 (a fixture)
from test_sglang_protocol import _request

from arealite.api.types import GenerationRequest
from arealite.config.algo_checks import SGLANG_LORA_TARGET_MODULES
from arealite.config.loader import ConfigError, load_config
from arealite.config.schema import ArealiteConfig
from arealite.inference_client.sglang_client import SGLangClient
from arealite.inference_client.sglang_wire import SGLangWire
from arealite.weight_sync import DistributedTransfer, WeightPublisher, WeightSyncError, make_verifier

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def base_state(micro_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(micro_model_dir, dtype=torch.float32).state_dict()


# ------------------------------------------------------------------ 1: the start-up warm-up


class _Starting:
    """A strict embedded server whose start-up warm-up is slow: its request goes out
    ``delay`` seconds after it listens and must be answered within ``timeout`` seconds."""

    def __init__(self, model_dir: Path, log: Path, delay: float, timeout: float):
        self.addr = f"127.0.0.1:{free_port()}"
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "arealite.server", "--model-path", str(model_dir), "--host", "127.0.0.1",
             "--port", self.addr.rpartition(":")[2], "--weight-sync-timeout-s", "30", "--strict-sglang",
             "--warmup-delay-s", str(delay)],
            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
            env=run_env(SGLANG_WARMUP_TIMEOUT=str(timeout)))

    def wait_listening(self, timeout: float = 90) -> None:
        """Until /get_model_info answers (what the client's readiness probe asks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            try:
                if _request(self.addr, "/get_model_info", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{self.addr} never answered /get_model_info")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


class _SlowSource:
    """The trainer's weights, read slowly: the push lasts longer than the warm-up timeout."""

    def __init__(self, engine: Engine, delay_s: float):
        self.engine, self.delay_s = engine, delay_s

    def named_weight_buckets(self, bucket_bytes):
        time.sleep(self.delay_s)
        yield from self.engine.named_weight_buckets(bucket_bytes)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_a_push_at_start_up_waits_for_the_warm_up_and_keeps_a_slow_warming_server(
        micro_model_dir, tmp_path, loop_runner, base_state):  # noqa: F811 - the imported fixture
    """The stand-in models SGLang's warm-up: a server paused before its warm-up request is
    answered, for longer than SGLANG_WARMUP_TIMEOUT, exits. The client's first pause waits
    for the warm-up (/ready), so a push at start-up leaves the server alive and updated."""
    run = loop_runner
    paused = _Starting(micro_model_dir, tmp_path / "paused.log", delay=1.0, timeout=2.0)
    pushed = _Starting(micro_model_dir, tmp_path / "pushed.log", delay=2.0, timeout=3.0)
    client = None
    try:
        paused.wait_listening()
        assert _request(paused.addr, "/pause_generation", {"mode": "abort"})[0] == 200
        pushed.wait_listening()
        # Starting: the model-info route answers, /health and /ready do not (and do not generate).
        assert _request(pushed.addr, "/health", timeout=5)[0] == 503
        assert _request(pushed.addr, "/ready", timeout=5)[0] == 503
        client = _client(run, [pushed.addr])
        engine = Engine(perturbed_weights(base_state, 1), str(micro_model_dir))
        cfg = ArealiteConfig(weight_sync={"bucket_size_mb": 0.05, "timeout_s": 30, "verify_n_tensors": 0})
        transfer = DistributedTransfer(_cfg(), client.admin, run)
        slow = _SlowSource(engine, delay_s=7.0)
        verifier = make_verifier(cfg, client.admin, transfer, slow, probe_prompt=[5, 6, 7, 8, 9, 10])
        pub = WeightPublisher(transfer, slow, client.admin, run, parties=[client, engine], verifier=verifier)
        pub.init()
        try:
            assert pub.publish(1)["probe_mean_abs_diff"] <= 1e-3
        finally:
            pub.close()
        assert pushed.proc.poll() is None, pushed.log.read_text()[-2000:]
        assert set(_generate(run, client).output_versions) == {1}
        assert _request(pushed.addr, "/ready")[0] == 200
        # The server paused before its warm-up was answered killed itself, as SGLang does.
        paused.proc.wait(30)
        assert paused.proc.returncode != 0
        assert "SGLANG_WARMUP_TIMEOUT" in paused.log.read_text()
    finally:
        if client is not None:
            run(client.aclose())
        paused.stop()
        pushed.stop()


# ------------------------------------------------------------------ 2: the version label


class _MiddleBucketRefused:
    """Three buckets; the middle one holds a tensor of the wrong shape, which the servers refuse."""

    def __init__(self, state: dict):
        self.items = list(state.items())

    def named_weight_buckets(self, bucket_bytes):
        yield self.items[:2]
        name, t = self.items[2]
        yield [(name, torch.zeros(t.numel() + 1))]
        yield self.items[3:5]


class _ThreeBuckets:
    def __init__(self, state: dict):
        self.items = list(state.items())

    def named_weight_buckets(self, bucket_bytes):
        yield from (self.items[:2], self.items[2:4], self.items[4:])


def _labels(addrs: list[str]) -> list[str]:
    return [_request(a, "/get_model_info")[1]["weight_version"] for a in addrs]


def test_a_push_failing_in_its_middle_bucket_leaves_no_server_labelled_new(
        micro_model_dir, tmp_path, loop_runner, base_state):  # noqa: F811 - the imported fixture
    """Strict servers relabel after every update call that carries weight_version, as SGLang's
    tokenizer manager does; only the last bucket carries it, so a push refused in its middle
    bucket leaves every server on its old label, and a whole push labels them all."""
    run = loop_runner
    servers = Servers(micro_model_dir, tmp_path, 2, extra=())
    client = _client(run, servers.addrs)
    try:
        assert _labels(servers.addrs) == ["0", "0"]
        run(client.admin.pause_generation())
        failing = DistributedTransfer(_cfg(), client.admin, run)
        failing.init()
        with pytest.raises(WeightSyncError):
            failing.transfer(_Weights(_MiddleBucketRefused(perturbed_weights(base_state, 2))), 1)
        failing.close()
        assert _labels(servers.addrs) == ["0", "0"], "a half-done push relabelled the servers"
        whole = DistributedTransfer(_cfg(), client.admin, run)
        whole.init()
        try:
            assert whole.transfer(_Weights(_ThreeBuckets(perturbed_weights(base_state, 3))), 2)["n_buckets"] == 3
        finally:
            whole.close()
        assert _labels(servers.addrs) == ["2", "2"]
    finally:
        run(client.admin.continue_generation())
        servers.stop()
        run(client.aclose())


# ------------------------------------------------------------------ 3 and 4: config


def _load(tmp_path: Path, text: str):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return load_config(path, [], check_paths=False)


@pytest.mark.parametrize("flags", [["--pp-size", "2"], ["--pp-size=4"], ["--pipeline-parallel-size", "2"],
                                   ["--pp-max-micro-batch-size", "8"]])
def test_pipeline_parallel_flags_are_refused_naming_the_field(tmp_path, flags):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, f"launch: {{server_backend: sglang}}\nserver: {{sglang: {{extra_args: {flags}}}}}\n")
    problems = [p for p in err.value.problems if p.path == "server.sglang.extra_args"]
    assert len(problems) == 1 and "pipeline" in problems[0].message and flags[0] in problems[0].message
    assert "launch.n_servers" in problems[0].message
    # A pipeline of one stage is no pipeline.
    _load(tmp_path, "launch: {server_backend: sglang}\nserver: {sglang: {extra_args: [--pp-size, '1']}}\n")


def test_lora_target_modules_are_held_to_sglangs_list_on_sglang_only(tmp_path):
    lora = "actor: {lora: {target_modules: [q_proj, c_attn, v_proj]}}\n"
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, "launch: {server_backend: sglang}\n" + lora)
    (problem,) = [p for p in err.value.problems if p.path == "actor.lora.target_modules"]
    assert "c_attn" in problem.message and "q_proj" not in problem.message.split(":")[0]
    assert all(name in problem.message for name in SGLANG_LORA_TARGET_MODULES)
    _load(tmp_path, "launch: {server_backend: embedded}\n" + lora)  # the embedded server adapts any linear
    _load(tmp_path, "launch: {server_backend: sglang}\nactor: {lora: {target_modules: [qkv_proj, gate_up_proj]}}\n")


# ------------------------------------------------------------------ 5: docs/sglang.md


def _route_rows(text: str) -> dict[str, list[str]]:
    """The routes table of docs/sglang.md: first cell -> cells."""
    section = text.split("## Routes the client calls", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {r.split(" | ")[0]: [c.strip() for c in r.strip("|").split(" | ")] for r in rows}


def test_sglang_doc_names_0521s_request_class_the_start_up_probe_and_every_source_file():
    text = (REPO / "docs" / "sglang.md").read_text()
    assert "GenerateReqInput" in text and "managers/io_struct.py" in text
    assert not re.search(r"\bGenerateRequest\b", text) and "api_types.py" not in text
    rows = _route_rows(text)
    assert len(rows) >= 12
    # The route the client's start-up readiness asks first is the one the table says it is.
    first = [*reversed(SGLangWire.liveness_routes), SGLangWire.health_route][0]
    (probe_row,) = [cells for head, cells in rows.items() if f"GET {first}`" in head]
    assert "start-up" in probe_row[1]
    (health_row,) = [cells for head, cells in rows.items() if head.startswith("| `GET /health`")]
    assert not health_row[1].startswith("start-up")
    for head, cells in rows.items():  # every route names its source file(s) in the release
        assert re.search(r"`[a-z_]+/[a-z_/]+\.py`", cells[3]), f"{head}: no source file in {cells[3]!r}"


# ------------------------------------------------------------------ 6: float token ids


@pytest.mark.parametrize(("ids", "position"), [([5.9, 6, 7], 0), ([5, 6.7, 7], 1), ([5, 6, 7.0], 2),
                                               (np.array([5.0, 6.0]), 0), (torch.tensor([5, 6.5]), 0)])
async def test_float_token_ids_are_refused_naming_the_request_and_the_position(ids, position):
    async with SGLangClient(["127.0.0.1:9"]) as client:  # refused before anything is sent
        with pytest.raises(ValueError, match=rf"input_ids\[{position}\] of request r-float is "):
            await client.agenerate(GenerationRequest(input_ids=ids, rid="r-float"))


async def test_integer_token_ids_of_any_kind_are_sent_as_ints():
    fake = await FakeSGLang().start()
    try:
        async with SGLangClient([fake.addr]) as client:
            await client.initialize(30)
            out = await client.agenerate(GenerationRequest(input_ids=[5, np.int64(6), torch.tensor(7), np.int32(8)]))
            also = await client.agenerate(GenerationRequest(input_ids=torch.tensor([5, 6, 7, 8])))
    finally:
        await fake.stop()
    assert out.input_ids == also.input_ids == [5, 6, 7, 8]
    assert [p["input_ids"] for p in fake.generate_payloads] == [[5, 6, 7, 8]] * 2
    assert {type(t) for p in fake.generate_payloads for t in p["input_ids"]} == {int}
