"""`launch.placement`: what each placement asks of the config, and the time-shared turns'
deadlines and retries (`arealite.trainer.colocation.TimeSharing`)."""

from __future__ import annotations

import asyncio

import pytest

from arealite.config.launch import TimeSharingConfig
from arealite.config.placement_checks import check_placement
from arealite.config.schema import ArealiteConfig
from arealite.plan.shared_split import shared_split_problems
from arealite.server.command_line import sglang_server_command
from arealite.config.weight_sync import WeightSyncConfig
from arealite.trainer.colocation import ServersAsleepError, TimeSharing
from arealite.weight_sync import push_method


def _fields(problems):
    return [p.path for p in problems]


def test_colocated_is_synchronous_and_the_checks_name_the_fields():
    cfg = ArealiteConfig()
    assert check_placement(cfg) == []  # disaggregated: nothing asked
    cfg.launch.placement = "colocated"
    problems = check_placement(cfg)
    assert _fields(problems) == ["rollout.max_head_offpolicyness"]
    assert "synchronous" in problems[0].message and "shared" in problems[0].message
    cfg.rollout.max_head_offpolicyness = 0
    assert check_placement(cfg) == []
    assert push_method(cfg) == "tensor"  # by default in this placement; a method set is kept
    assert push_method(cfg.model_copy(update={"weight_sync": WeightSyncConfig(method="shm")})) == "shm"
    cfg.launch.server_backend, cfg.launch.n_servers, cfg.launch.n_trainer_procs = "sglang", 1, 2
    assert _fields(check_placement(cfg)) == ["launch.n_servers"]  # 1 server GPU for 2 trainer GPUs
    cfg.actor.model_path = "m"
    assert "--enable-memory-saver" in sglang_server_command(cfg, 30000)  # the launcher adds the flag
    cfg.server.sglang.tp_size = 2
    assert check_placement(cfg) == []
    cfg.launch.placement = "shared"
    cfg.rollout.max_head_offpolicyness = 2  # shared overlaps as disaggregated does
    assert check_placement(cfg) == []


def test_shared_split_is_checked_by_the_planner(tiny_model_dir):
    cfg = ArealiteConfig()
    cfg.actor.model_path = str(tiny_model_dir)
    cfg.launch.placement, cfg.launch.gpus = "shared", "H100"
    assert shared_split_problems(cfg) == []  # a 1M-parameter model beside its server on 80 GB
    cfg.launch.gpu_memory_gib = 0.01  # 10 MiB cannot hold both
    problems = shared_split_problems(cfg)
    assert _fields(problems) == ["launch.placement"] and "colocated" in problems[0].message
    cfg.launch.server_backend = "sglang"
    problems = shared_split_problems(cfg)
    assert _fields(problems) == ["server.sglang.mem_fraction_static"]
    cfg.launch.placement = "disaggregated"
    assert shared_split_problems(cfg) == []


class _FlakyServers:
    """The servers' memory routes as the admin client exposes them, failing the first
    ``failures`` resumes (or never answering: ``hang``)."""

    healthy_servers = ["127.0.0.1:1"]

    def __init__(self, failures: int = 0, hang: bool = False):
        self.failures, self.hang, self.calls = failures, hang, []

    async def pause_generation(self, mode=None):
        self.calls.append("pause")

    async def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tuple(tags)))
        if self.hang:
            await asyncio.sleep(60)

    async def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tuple(tags)))
        if self.failures:
            self.failures -= 1
            raise RuntimeError("/resume_memory_occupation: HTTP 500")


def _sharing(admin, **cfg) -> TimeSharing:
    return TimeSharing(TimeSharingConfig(**cfg), [], admin, asyncio.run, rank=0)


def test_a_failing_resume_is_retried_then_reported(monkeypatch):
    monkeypatch.setattr("arealite.trainer.colocation.time.sleep", lambda s: None)
    admin = _FlakyServers(failures=2)
    sharing = _sharing(admin, resume_attempts=3)
    sharing.after_read()  # nothing released: nothing resumed (SGLang dies resuming a tag it holds)
    assert admin.calls == []
    sharing.trainer_turn()
    sharing.after_read()  # the KV cache comes back on the third try
    assert admin.calls == ["pause", ("release", ("weights", "kv_cache"))] + [("resume", ("kv_cache",))] * 3
    assert sharing.asleep == ["weights"]
    admin = _FlakyServers(failures=5)
    sharing = _sharing(admin, resume_attempts=3)
    sharing.trainer_turn()
    with pytest.raises(ServersAsleepError, match=r"kv_cache.*failed 3 time\(s\).*HTTP 500"):
        sharing.after_read()


def test_every_wait_names_what_it_waited_for():
    sharing = _sharing(_FlakyServers(hang=True), memory_timeout_s=0.2)
    with pytest.raises(ServersAsleepError, match=r"release_memory_occupation.*127.0.0.1:1.*0.2s.*memory_timeout_s"):
        sharing.trainer_turn()


def test_an_admin_without_the_memory_routes_is_refused():
    with pytest.raises(TypeError, match="release_memory_occupation"):
        TimeSharing(TimeSharingConfig(), [], object(), asyncio.run, rank=0)
