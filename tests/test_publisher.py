"""`WeightPublisher.publish`: one call, one order, for every transfer.

- the order, with strict recording fakes (nothing else is faked for it): the controller
  pauses before the servers do, the servers pause before the transfer, the version is
  set on every party before generation continues and the controller resumes; a failed
  transfer or verification leaves the servers paused and the controller paused, sets no
  version and raises;
- two trainer ranks (gloo, real processes): a failure on rank 0 mid-iteration stops
  rank 1 with an error instead of a hang, and a success sets the version on both;
- real parts: an embedded server, the real client, a started `RolloutController` and
  `make_publisher` for each `weight_sync.method`; a verification that fails and a
  transfer the server refuses, each leaving the server paused.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, RolloutOf, free_port, perturbed_weights, stop_process

from arealite.api.types import GenerationRequest, SamplingParams
from arealite.config.schema import ArealiteConfig, RolloutConfig
from arealite.inference_client.sglang_client import SGLangClient, ServerAdminError
from arealite.weight_sync import (
    ReadbackVerifier,
    StateDictSource,
    WeightPublisher,
    WeightSyncError,
    make_publisher,
)
from arealite.weight_sync.base import drain

SERVER = "127.0.0.1:1"


# ------------------------------------------------------------ strict recording fakes


class Log(list):
    def rec(self, *what) -> None:
        self.append(":".join(str(w) for w in what))


class StrictAdmin:
    """A `WeightUpdateAdmin` that records the calls a publisher may make and refuses the rest."""

    def __init__(self, log: Log, held: dict[str, torch.Tensor], *, refuse: str | None = None):
        self.log, self.held, self.refuse = log, held, refuse

    @property
    def healthy_servers(self) -> list[str]:
        return [SERVER]

    @property
    def servers(self) -> list[str]:
        return [SERVER]

    def server_info(self, addr: str) -> dict:
        return {}

    def out_of_rotation(self) -> dict[str, str]:
        return {}

    async def drop_unreachable(self, addrs=None, why: str = "") -> list[str]:
        self.log.rec("admin.drop_unreachable")
        return []  # every server answers: a failure is a refusal, not a dead server

    async def _route(self, route: str) -> dict:
        self.log.rec("admin." + route)
        if route == self.refuse:
            raise ServerAdminError("/" + route, {SERVER: "HTTP 400: refused"}, {})
        return {SERVER: {"success": True}}

    async def pause_generation(self) -> dict:
        return await self._route("pause_generation")

    async def continue_generation(self) -> dict:
        return await self._route("continue_generation")

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> dict:
        self.log.rec("admin.get_weights_by_name")
        return {SERVER: self.held[name][:truncate_size].tolist()}

    async def update_weights_from_disk(self, path: str, version: int, timeout=None) -> dict:
        raise AssertionError("a publisher never loads weights itself: its transfer does")


class RecordingTransfer:
    """A `WeightTransfer` that records its calls, reads the source like the real ones and
    can fail in `stage` or `transfer`."""

    bucket_bytes = 1 << 20

    def __init__(self, log: Log, *, fail_in: str | None = None):
        self.log, self.fail_in = log, fail_in

    def init(self) -> None:
        self.log.rec("transfer.init")

    def stage(self, source, version: int) -> dict[str, float]:
        self.log.rec("transfer.stage", version)
        drain(source, self.bucket_bytes)
        if self.fail_in == "stage":
            raise WeightSyncError("the disk is full", version=version)
        return {"write_s": 0.0}

    def transfer(self, source, version: int) -> dict[str, float]:
        self.log.rec("transfer.transfer", version)
        if self.fail_in == "transfer":
            raise WeightSyncError("the server refused the weights", server=SERVER, version=version)
        return {"load_s": 0.0, "n_tensors": 2.0}

    def close(self) -> None:
        self.log.rec("transfer.close")


class Party:
    def __init__(self, log: Log, name: str):
        self.log, self.name, self.version = log, name, 0

    def set_version(self, version: int) -> None:
        self.log.rec(self.name + ".set_version", version)
        self.version = version


class Controller(Party):
    def __init__(self, log: Log):
        super().__init__(log, "controller")
        self.paused = False

    def pause(self) -> None:
        self.log.rec("controller.pause")
        self.paused = True

    def resume(self) -> None:
        self.log.rec("controller.resume")
        self.paused = False


STATE = {"a.weight": torch.arange(12.0).reshape(4, 3), "b.bias": torch.linspace(-1, 1, 5)}


def _parts(log: Log, *, held=None, refuse=None, fail_in=None, verify=True):
    admin = StrictAdmin(log, held if held is not None else STATE, refuse=refuse)
    engine, client, controller = Party(log, "engine"), Party(log, "client"), Controller(log)
    pub = WeightPublisher(RecordingTransfer(log, fail_in=fail_in), StateDictSource(STATE), admin, asyncio.run,
                          parties=[engine, client], controller=controller,
                          verifier=ReadbackVerifier(admin, 2) if verify else None)
    pub.init()
    log.clear()
    return pub, engine, client, controller


AFTER_TRANSFER = ["admin.get_weights_by_name", "admin.get_weights_by_name",
                  "engine.set_version:3", "client.set_version:3", "controller.set_version:3",
                  "admin.continue_generation", "controller.resume"]


def test_publish_runs_the_whole_sequence_in_order():
    log = Log()
    pub, engine, client, controller = _parts(log)
    timings = pub.publish(3)
    assert log == ["controller.pause", "transfer.stage:3", "admin.pause_generation", "transfer.transfer:3",
                   *AFTER_TRANSFER]
    assert engine.version == client.version == controller.version == 3 and not controller.paused
    assert {"write_s", "load_s", "n_tensors", "pause_s", "verify_s", "continue_s", "total_s"} <= set(timings)
    # Each phase's client CPU, and the share while generation is held, are logged with the wall times.
    phases = ("pause", "transfer", "verify", "continue")
    assert all(timings[f"{k}_client_cpu_s"] >= 0.0 for k in (*phases, "stage", "probe", "total"))
    assert timings["held_client_cpu_s"] == pytest.approx(sum(timings[f"{k}_client_cpu_s"] for k in phases))
    assert timings["held_client_cpu_s"] <= timings["total_client_cpu_s"] + 1e-9
    pub.close()
    assert log[-1] == "transfer.close"


@pytest.mark.parametrize("fail_in", ["stage", "transfer"])
def test_a_failed_transfer_sets_no_version_and_resumes_nothing(fail_in):
    log = Log()
    pub, engine, client, controller = _parts(log, fail_in=fail_in)
    with pytest.raises(WeightSyncError, match="full" if fail_in == "stage" else "refused"):
        pub.publish(3)
    upto = {"stage": ["controller.pause", "transfer.stage:3"],
            "transfer": ["controller.pause", "transfer.stage:3", "admin.pause_generation", "transfer.transfer:3"]}
    assert log == upto[fail_in], "nothing after the failure: no verify, no version, no continue, no resume"
    assert controller.paused and engine.version == client.version == controller.version == 0


def test_a_failed_verification_leaves_the_servers_paused():
    log = Log()
    held = dict(STATE, **{"b.bias": STATE["b.bias"] + 0.5})  # the server holds something else
    pub, engine, client, controller = _parts(log, held=held)
    with pytest.raises(WeightSyncError, match="read-back mismatch") as err:
        pub.publish(3)
    assert err.value.server == SERVER and err.value.tensor == "b.bias" and err.value.version == 3
    assert log[:4] == ["controller.pause", "transfer.stage:3", "admin.pause_generation", "transfer.transfer:3"]
    assert set(log[4:]) == {"admin.get_weights_by_name"}, log
    assert controller.paused and engine.version == client.version == controller.version == 0


def test_a_refused_pause_stops_before_the_transfer():
    log = Log()
    pub, _, _, controller = _parts(log, refuse="pause_generation")
    with pytest.raises(WeightSyncError, match="pause_generation: HTTP 400: refused"):
        pub.publish(3)
    assert log == ["controller.pause", "transfer.stage:3", "admin.pause_generation", "admin.drop_unreachable"]
    assert controller.paused


class RecordingVerifier:
    """A verifier that records its steps (and can fail the serving check)."""

    def __init__(self, log, fail_serving: bool = False):
        self.log, self.fail_serving = log, fail_serving

    def prepare(self, version):
        self.log.rec("verifier.prepare", version)

    def observe(self, source, version):
        return source

    def verify(self, version, call):
        self.log.rec("verifier.verify", version)
        return {"checked": 1.0}

    def check_serving(self, version, call):
        self.log.rec("verifier.check_serving", version)
        if self.fail_serving:
            raise WeightSyncError("probe mismatch", server="s0", version=version)
        return {"probe_mean_abs_diff": 0.0}


def test_verifier_steps_take_their_places():
    """prepare before anything moves, verify while paused, the probe once generation runs."""
    log = Log()
    admin = StrictAdmin(log, STATE)
    controller = Controller(log)
    pub = WeightPublisher(RecordingTransfer(log), StateDictSource(STATE), admin, asyncio.run,
                          controller=controller, verifier=RecordingVerifier(log))
    pub.init()
    out = pub.publish(4)
    assert log == ["transfer.init", "controller.pause", "verifier.prepare:4", "transfer.stage:4",
                   "admin.pause_generation", "transfer.transfer:4", "verifier.verify:4",
                   "controller.set_version:4", "admin.continue_generation", "verifier.check_serving:4",
                   "controller.resume"]
    assert out["checked"] == 1.0 and out["probe_mean_abs_diff"] == 0.0 and "probe_s" in out


def test_a_failed_serving_check_pauses_the_servers_again():
    log = Log()
    admin = StrictAdmin(log, STATE)
    controller = Controller(log)
    pub = WeightPublisher(RecordingTransfer(log), StateDictSource(STATE), admin, asyncio.run,
                          controller=controller, verifier=RecordingVerifier(log, fail_serving=True))
    pub.init()
    with pytest.raises(WeightSyncError, match="probe mismatch"):
        pub.publish(4)
    assert log[-3:] == ["admin.continue_generation", "verifier.check_serving:4", "admin.pause_generation"]
    assert "controller.resume" not in log


def test_wrong_objects_and_a_publish_before_init_are_refused():
    log = Log()
    admin = StrictAdmin(log, STATE)
    with pytest.raises(TypeError, match="the weight transfer is a object, which does not implement WeightTransfer"):
        WeightPublisher(object(), StateDictSource(STATE), admin, asyncio.run)
    with pytest.raises(TypeError, match="does not implement WeightUpdateAdmin"):
        WeightPublisher(RecordingTransfer(log), StateDictSource(STATE), object(), asyncio.run)
    with pytest.raises(TypeError, match="has no set_version"):
        WeightPublisher(RecordingTransfer(log), StateDictSource(STATE), admin, asyncio.run, parties=[object()])
    pub = WeightPublisher(RecordingTransfer(log), StateDictSource(STATE), admin, asyncio.run)
    with pytest.raises(RuntimeError, match="before init"):
        pub.publish(1)
    assert log == []


# ------------------------------------------------------------ two trainer ranks

_RANK_SCRIPT = textwrap.dedent("""
    import asyncio, datetime, json, sys
    import torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[4])
    from test_publisher import STATE, Controller, Log, Party, RecordingTransfer, StrictAdmin
    from arealite.weight_sync import StateDictSource, WeightPublisher, WeightSyncError
    from arealite.weight_sync.base import drain

    rank, port, scenario = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))

    class Sharded(StateDictSource):
        # Unsharding is a collective: one all-reduce per tensor, as FSDP's all-gathers.
        reads = 0

        def named_weight_buckets(self, bucket_bytes):
            Sharded.reads += 1
            for name, t in self.tensors:
                dist.all_reduce(torch.ones(1))
                yield [(name, t)]

    class Broadcasting(RecordingTransfer):
        # Reads the source in stage (as disk) and again in the transfer (as distributed, or
        # as a retry after a lost server): the other ranks must read it as often.
        def transfer(self, source, version):
            self.log.rec("transfer.transfer", version)
            for i, bucket in enumerate(source.named_weight_buckets(self.bucket_bytes)):
                if rank == 0 and self.fail_in == "transfer" and i == 0:
                    raise WeightSyncError("a server refused the first bucket", version=version)
            return {}

    log = Log()
    admin, transfer = StrictAdmin(log, STATE), Broadcasting(log)
    controller, engine = Controller(log), Party(log, "engine")
    pub = WeightPublisher(transfer, Sharded(STATE), admin, asyncio.run, parties=[engine], controller=controller)
    pub.init()
    pub.publish(1)
    out = {"first": engine.version}
    # Then rank 0 fails: in the middle of the buckets, or before reading any.
    transfer.fail_in = scenario
    admin.refuse = "pause_generation" if scenario == "pause" else None
    try:
        pub.publish(2)
        out["second"] = "ok"
    except WeightSyncError as e:
        out["second"] = str(e)
    out.update(paused=controller.paused, version=engine.version, reads=Sharded.reads)
    dist.barrier()  # both ranks are still in step
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("scenario", ["transfer", "pause"])
def test_a_failure_on_rank_0_stops_every_rank_without_a_hang(scenario):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT, str(r), str(port), scenario,
                               str(Path(__file__).parent)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env) for r in range(2)]
    outs = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a trainer rank hung")
        assert p.returncode == 0, text[-3000:]
        outs.append(json.loads(text.split("RESULT ", 1)[1]))
    rank0, rank1 = outs
    assert rank0["first"] == rank1["first"] == 1, "a good update sets the version on every rank"
    assert "refused" in rank0["second"] and "trainer rank 0 failed" in rank1["second"]
    assert rank0["paused"] and rank1["paused"], "no rank resumes its controller after a failure"
    assert rank0["version"] == rank1["version"] == 1
    assert rank0["reads"] == rank1["reads"] == (4 if scenario == "transfer" else 3), \
        "every rank reads the (collective) source as often as rank 0"


# ------------------------------------------------------------ real parts


class Engine(StateDictSource):
    """The trainer's engine as far as publishing goes: weights, a version, a model path, and a
    real forward of those weights (the log-prob probe's trainer side)."""

    def __init__(self, state, model_path: str):
        super().__init__(state)
        self.config = type("Cfg", (), {"model_path": model_path})()
        self.version = 0
        self.probe_forwards = 0

    def forward(self, batch, post_hook, out_dtype=torch.float32):
        from transformers import AutoModelForCausalLM

        from arealite.train_engine.lm_head import ChunkedHead

        model = AutoModelForCausalLM.from_pretrained(self.config.model_path, dtype=torch.float32)
        model.load_state_dict(dict(self.tensors), strict=False)
        model.tie_weights()
        ids = batch["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1]
        out = torch.zeros(ids.shape, dtype=out_dtype)
        out[0, 1:] = post_hook(ChunkedHead.from_logits(logits), {"labels": ids[0, 1:]})
        self.probe_forwards += 1
        return out

    def set_version(self, version: int) -> None:
        self.version = version

    def get_version(self) -> int:
        return self.version


@pytest.fixture(scope="module")
def server(micro_model_dir, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("publisher") / "server.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "arealite.server", "--model-path", str(micro_model_dir),
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1"),
        start_new_session=True)
    yield f"127.0.0.1:{port}"
    stop_process(proc, 10)


@pytest.fixture
def rollout(server):
    """A real client under a started controller (which waits for the server's health)."""
    from arealite.rollout.controller import RolloutController

    client = SGLangClient([server], RolloutConfig(request_timeout_s=60))
    controller = RolloutController(client, RolloutConfig()).start(init_timeout=90)
    yield client, controller
    controller.stop()



def _config(tmp_path: Path, method: str, model_dir: Path) -> ArealiteConfig:
    return ArealiteConfig.model_validate({
        "experiment": {"output_root": str(tmp_path), "name": "e", "trial": "t"},
        "actor": {"model_path": str(model_dir)},
        "weight_sync": {"method": method, "bucket_size_mb": 0.05, "verify_n_tensors": 3, "timeout_s": 30,
                        "shm_dir": str(tmp_path)}})


def _server_has(controller, client, state) -> bool:
    for name, t in state.items():
        (values,) = controller.run(client.get_weights_by_name(name, 10**6)).values()
        if not torch.equal(torch.tensor(values, dtype=torch.float32).flatten(), t.flatten().float()):
            return False
    return True


def _generate(controller, client):
    req = GenerationRequest(input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=4, greedy=True))
    return controller.run(client.agenerate(req))


@pytest.mark.parametrize("method", ["distributed", "disk", "shm", "tensor"])
def test_make_publisher_publishes_with_real_parts(rollout, method, base_state, micro_model_dir, tmp_path):
    client, controller = rollout
    engine = Engine(perturbed_weights(base_state, 1), str(micro_model_dir))
    pub = make_publisher(_config(tmp_path, method, micro_model_dir), RolloutOf(client, controller), engine)
    pub.init()
    try:
        for version in (1, 2):
            timings = pub.publish(version)
            assert timings["total_s"] > 0 and timings["n_tensors"] == len(engine.tensors)
            assert engine.get_version() == controller.get_version() == client.get_version() == version
            assert not controller.paused
            assert _server_has(controller, client, dict(engine.tensors))
            assert set(_generate(controller, client).output_versions) == {version}
            # The log-prob probe ran: the trainer's forward, and the server agreed within 1e-3.
            assert engine.probe_forwards == 1 and timings["probe_mean_abs_diff"] <= 1e-3
            engine.__init__(perturbed_weights(base_state, 2), str(micro_model_dir))
    finally:
        pub.close()


class SendsOther:
    """A buggy transfer: it reads the trainer's weights but loads other ones."""

    def __init__(self, inner, other):
        self.inner, self.other = inner, StateDictSource(other)

    @property
    def bucket_bytes(self) -> int:
        return self.inner.bucket_bytes

    def init(self) -> None:
        self.inner.init()

    def stage(self, source, version: int) -> dict[str, float]:
        drain(source, self.bucket_bytes)
        return self.inner.stage(self.other, version)

    def transfer(self, source, version: int) -> dict[str, float]:
        return self.inner.transfer(self.other, version)

    def close(self) -> None:
        self.inner.close()


class Transposed(StateDictSource):
    """An engine bug: one tensor with another shape (the server refuses the update)."""

    def named_weight_buckets(self, bucket_bytes):
        victim = next(n for n, t in self.tensors if t.dim() == 2 and t.shape[0] != t.shape[1])
        yield [(n, t.t().contiguous() if n == victim else t) for n, t in self.tensors]


@pytest.mark.parametrize("fault", ["verify", "transfer"])
def test_a_failed_update_leaves_the_real_server_paused(rollout, fault, base_state, micro_model_dir, tmp_path):
    client, controller = rollout
    engine = Engine(perturbed_weights(base_state, 3), str(micro_model_dir))
    good = make_publisher(_config(tmp_path, "disk", micro_model_dir), RolloutOf(client, controller), engine)
    good.init()
    good.publish(1)
    transfer = good.transfer if fault == "transfer" else SendsOther(good.transfer, perturbed_weights(base_state, 4))
    source = Transposed(perturbed_weights(base_state, 5)) if fault == "transfer" else engine
    bad = WeightPublisher(transfer, source, client.admin, controller.run, parties=[engine, client],
                          controller=controller, verifier=ReadbackVerifier(client.admin, 50))
    bad.init()
    needle = "read-back mismatch" if fault == "verify" else "update_weights_from_disk"
    with pytest.raises(WeightSyncError, match=needle) as err:
        bad.publish(2)
    assert err.value.server == client.servers[0] and err.value.version == 2
    assert controller.paused, "the controller is not resumed"
    assert engine.get_version() == controller.get_version() == client.get_version() == 1, "no version is set"
    # The servers stay paused: a generation does not finish.
    req = GenerationRequest(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=2, greedy=True))
    fut = asyncio.run_coroutine_threadsafe(client.agenerate(req), client.pool.loop)
    time.sleep(1.0)
    assert not fut.done(), "a server whose update failed must not serve"
    controller.run(client.continue_generation())  # what an operator would do after fixing it
    assert fut.result(30).finish_reason in ("stop", "length")
    controller.resume()
    good.close()


def test_probe_runs_on_due_versions_and_catches_a_stale_or_wrong_server():
    from arealite.weight_sync import LogprobProbe

    calls = []

    class Servers:
        healthy_servers = ["s0"]
        served = (None, [-1.0, -2.0, -3.0])

        async def score_prompt(self, ids):
            calls.append("server")
            return {"s0": (list(self.served[1]), self.served[0])}

    def score(ids):
        calls.append("trainer")
        return [-1.0, -2.0, -3.0]

    servers = Servers()
    probe = LogprobProbe(servers, score, [1, 2, 3, 4], tolerance=1e-3, every=2)
    call = lambda make_coro, what: asyncio.run(make_coro())  # noqa: E731
    probe.prepare(1)
    assert probe.check_serving(1, call) == {} and calls == [], "version 1 is not due"
    servers.served = (2, [-1.0, -2.0, -3.0])
    probe.prepare(2)
    out = probe.check_serving(2, call)
    assert calls == ["trainer", "server"] and out["probe_mean_abs_diff"] == 0.0
    servers.served = (3, [-1.0, -2.0, -3.0])  # still on 3 when 4 was pushed
    probe.prepare(4)
    with pytest.raises(WeightSyncError, match="not the version just pushed"):
        probe.check_serving(4, call)
    servers.served = (6, [-1.0, -2.5, -3.0])
    probe.prepare(6)
    with pytest.raises(WeightSyncError, match="log-prob probe mismatch") as err:
        probe.check_serving(6, call)
    assert err.value.server == "s0"
