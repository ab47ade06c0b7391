"""The Ray launcher on a real Ray cluster of two simulated nodes on this machine.

Ray's own cluster utilities start two raylets: the head offers a `server_node` resource,
the other a `trainer_node` one, so that servers and trainer ranks land on different
nodes (and `launch.ray.separate_nodes` is checked too). Both nodes advertise 127.0.0.1,
so the test talks to loopback only: every address the launcher hands out is the node IP
Ray reports (never a guess of its own), and here that is loopback. The launcher runs as
`python -m arealite.launcher.ray` in a subprocess with the CPU demo: 2 embedded
servers, 2 trainer ranks, the weights pushed over a gloo group on loopback
(`GLOO_SOCKET_IFNAME=lo`, which the launcher passes on).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from arealite.config.schema import ArealiteConfig
from arealite.launcher import placement
from arealite.launcher.common import ExitCode
from conftest import free_port, run_env
from test_launcher import _alive

ray = pytest.importorskip("ray")

NODE_MB = 80 * 2**20  # Ray's smallest object store: the launcher sends no objects
LOOPBACK = "127.0.0.1"


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"server_node": 2}, "include_dashboard": False,
        "object_store_memory": NODE_MB, "node_ip_address": LOOPBACK})
    c.add_node(num_cpus=2, resources={"trainer_node": 2}, object_store_memory=NODE_MB, node_ip_address=LOOPBACK)
    c.wait_for_nodes()
    assert c.address.startswith(f"{LOOPBACK}:"), c.address
    yield c
    c.shutdown()


def _config(demo: Path, runs: Path, **sections) -> dict:
    cfg = {
        "experiment": {"name": "ray", "trial": "t", "output_root": str(runs)},
        "launch": {"n_servers": 2, "n_trainer_procs": 2, "server_startup_timeout_s": 120,
                   "ray": {"server_cpus": 0.5, "trainer_cpus": 0.5, "separate_nodes": True,
                           "server_resources": {"server_node": 1},
                           "trainer_resources": {"trainer_node": 1}}},
        "rollout": {"consumer_batch_size": 4, "max_head_offpolicyness": 1},
        "generation": {"n_samples": 4, "max_new_tokens": 8},
        "actor": {"model_path": str(demo / "model")},
        "data": {"train_path": str(demo / "train.jsonl"), "eval_path": None, "max_train_steps": 3,
                 "reward_fn": "arealite.reward.reverse_digits:reverse_digits_reward"},
        "saver": {"export_hf_at_end": False},
        "stats": {"progress_bar": False, "plot": False},
        # A survivor of a server killed mid-push waits for its group's timeout (as SGLang's
        # scheduler would): keep it short here.
        "weight_sync": {"bucket_size_mb": 0.05, "timeout_s": 20},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


class RayRun:
    """One `python -m arealite.launcher.ray` in a subprocess."""

    def __init__(self, tmp: Path, cfg: dict, address: str, *overrides: str):
        self.tmp = tmp
        (tmp / "cfg.yaml").write_text(yaml.safe_dump(cfg))
        self.err_path = tmp / f"launcher{len(list(tmp.glob('launcher*.err')))}.err"
        # gloo would otherwise pick the interface its hostname resolves to.
        env = run_env(AREALITE_LAUNCHER_GRACE_S="5", GLOO_SOCKET_IFNAME="lo")
        env.pop("AREALITE_SERVER_ADDRS", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "arealite.launcher.ray", "--config", str(tmp / "cfg.yaml"),
             f"launch.ray.address={address}", *overrides],
            stdout=open(tmp / "launcher.out", "ab"), stderr=open(self.err_path, "wb"), env=env, cwd=tmp)
        self.run_dir = Path(cfg["experiment"]["output_root"]) / cfg["experiment"]["name"] / cfg["experiment"]["trial"]

    def err(self) -> str:
        return self.err_path.read_text(errors="replace")

    def started(self) -> dict[str, dict]:
        """name -> {pid, actor_pid, node, addr} from the launcher's `started` lines."""
        out = {}
        for m in re.finditer(r"started (\w+) \(pid (\d+), actor pid (\d+), node (\w+) at ([\d.]+)\)(?: on (\S+);)?",
                             self.err()):
            out[m[1]] = {"pid": int(m[2]), "actor_pid": int(m[3]), "node": m[4], "ip": m[5], "addr": m[6]}
        return out

    def assert_loopback_only(self) -> None:
        """Every address the launcher joined, started a process at or handed a trainer is loopback."""
        err = self.err()
        joined = re.findall(r"joined the Ray cluster at (\S+):", err)
        rendezvous = re.findall(r"rendezvous at (\S+)", err)
        assert joined and rendezvous, err
        addrs = [*joined, *rendezvous, *(a for s in self.started().values() for a in (s["ip"], s["addr"]) if a)]
        assert all(a.startswith("127.") for a in addrs), addrs

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)
            raise

    def steps(self) -> list[dict]:
        path = self.run_dir / "stats.jsonl"
        if not path.exists():
            return []
        return [r for r in map(json.loads, path.read_text().splitlines()) if "rollout/reward_mean" in r]

    def wait_step(self, step: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not [r for r in self.steps() if r["step"] >= step]:
            assert self.proc.poll() is None, f"launcher exited early:\n{self.err()}"
            assert time.monotonic() < deadline, f"step {step} never came:\n{self.err()}"
            time.sleep(0.3)


def _assert_all_gone(started: dict[str, dict], within: float = 20.0) -> None:
    pids = [p for s in started.values() for p in (s["pid"], s["actor_pid"])]
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], "a process or actor survived the launcher"


# ---------------------------------------------------------------- placement (no cluster)

NODES = {"head": {"CPU": 2.0, "server_node": 2.0}, "other": {"CPU": 2.0, "trainer_node": 2.0}}


def _cfg(**launch) -> ArealiteConfig:
    return ArealiteConfig.model_validate({"launch": launch})


def test_placement_fits_roles_on_their_nodes_and_names_the_keys_when_it_cannot():
    ray_cfg = {"server_resources": {"server_node": 1}, "trainer_resources": {"trainer_node": 1}}
    placement.check_fits(_cfg(n_servers=2, n_trainer_procs=2, ray=ray_cfg), NODES)
    with pytest.raises(ValueError, match=r"3 server\(s\).*only 2 of 3.*launch.n_servers, launch.ray.server_cpus"):
        placement.check_fits(_cfg(n_servers=3, ray=ray_cfg), NODES)
    with pytest.raises(ValueError, match=r"trainer rank.*launch.n_trainer_procs"):
        placement.check_fits(_cfg(n_trainer_procs=2, ray={"trainer_gpus": 1}), NODES)
    # One node holding both roles cannot keep them apart.
    one = {"head": {"CPU": 8.0}}
    placement.check_fits(_cfg(n_servers=1, n_trainer_procs=2), one)
    with pytest.raises(ValueError, match="launch.ray.separate_nodes=true"):
        placement.check_fits(_cfg(n_servers=1, ray={"separate_nodes": True}), one)
    with pytest.raises(ValueError, match="STRICT_SPREAD"):
        placement.check_fits(_cfg(n_servers=2, n_trainer_procs=1, ray={"placement_strategy": "STRICT_SPREAD"}), one)
    server, _ = placement.roles(_cfg(server_backend="sglang", ray={"server_cpus": 4}))
    assert server.bundle == {"CPU": 4, "GPU": 1}  # SGLang: one GPU per tensor-parallel rank


def test_bad_ray_config_names_the_field():
    with pytest.raises(ValueError, match="launch.ray.server_resources"):
        ArealiteConfig.model_validate({"launch": {"ray": {"server_resources": {"GPU": 1}}}})
    with pytest.raises(ValueError, match="launch.ray.placement_strategy"):
        ArealiteConfig.model_validate({"launch": {"ray": {"placement_strategy": "ANY"}}})


def test_no_cluster_reachable_fails_fast_naming_the_address_key(tmp_path, micro_demo_dir):
    t0 = time.monotonic()
    run = RayRun(tmp_path, _config(micro_demo_dir, tmp_path / "runs"), f"127.0.0.1:{free_port()}")
    assert run.wait(60) == ExitCode.CLUSTER_UNAVAILABLE, run.err()
    assert "launch.ray.address" in run.err() and "cannot be reached" in run.err()
    assert time.monotonic() - t0 < 30 and not run.started()


# ---------------------------------------------------------------- on the cluster


@pytest.mark.slow
def test_too_small_a_cluster_fails_before_anything_starts(cluster, tmp_path, micro_demo_dir):
    cfg = _config(micro_demo_dir, tmp_path / "runs", launch={"n_servers": 3, "n_trainer_procs": 2, "ray": {
        "server_cpus": 0.5, "server_resources": {"server_node": 1}, "separate_nodes": True}})
    run = RayRun(tmp_path, cfg, cluster.address)
    assert run.wait(60) == ExitCode.CLUSTER_UNAVAILABLE, run.err()
    err = run.err()
    assert "only 2 of 3 server(s) fit" in err and "launch.n_servers, launch.ray.server_cpus" in err, err
    assert not run.started()


@pytest.mark.slow
def test_two_nodes_two_servers_two_ranks_train_end_to_end(cluster, tmp_path, micro_demo_dir):
    run = RayRun(tmp_path, _config(micro_demo_dir, tmp_path / "runs"), cluster.address, "server.api_key=k3y-r4y")
    assert run.wait() == ExitCode.OK, run.err()
    started = run.started()
    assert set(started) == {"server0", "server1", "trainer", "trainer1"}
    server_nodes = {started[n]["node"] for n in ("server0", "server1")}
    trainer_nodes = {started[n]["node"] for n in ("trainer", "trainer1")}
    assert len(server_nodes) == 1 and len(trainer_nodes) == 1 and server_nodes != trainer_nodes
    for s in ("server0", "server1"):  # bound and advertised on the IP Ray gave the node
        assert started[s]["addr"].startswith(f"{started[s]['ip']}:")
    run.assert_loopback_only()
    steps = run.steps()
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:  # learning as on one machine: full batches, bounded staleness, weights pushed
        assert r["rollout/n_trajectories"] == 16 and r["rollout/staleness_max"] <= 1
        assert r["weight_sync/total_s"] > 0
    logs = run.run_dir / "logs"
    for name in ("server0", "server1"):  # the gloo push crossed "nodes": servers joined the group
        text = (logs / f"{name}.log").read_text()
        assert "joined weight-update group" in text and "k3y-r4y" not in text
    assert (logs / "trainer.log").stat().st_size > 0 and (logs / "trainer1.log").stat().st_size > 0
    assert "k3y-r4y" not in run.err()
    _assert_all_gone(started)


@pytest.mark.slow
def test_dead_server_then_dead_trainer_rank_then_resume(cluster, tmp_path, micro_demo_dir):
    cfg = _config(micro_demo_dir, tmp_path / "runs", saver={"export_hf_at_end": False, "freq_steps": 1},
                  data={"max_train_steps": 8})
    run = RayRun(tmp_path, cfg, cluster.address)
    run.wait_step(1)
    started = run.started()
    os.kill(started["server1"]["actor_pid"], signal.SIGKILL)  # a server's actor dies: the run goes on
    # Ray can take seconds under load to call the actor dead, and a step here takes about one:
    # the trainer rank is killed only once the launcher has seen the server go.
    deadline = time.monotonic() + 90
    while "server1's actor is lost" not in run.err():
        assert time.monotonic() < deadline, run.err()
        time.sleep(0.2)
    run.wait_step(3)
    os.kill(started["trainer1"]["actor_pid"], signal.SIGKILL)  # a trainer rank's actor dies: all stops
    assert run.wait() == ExitCode.TRAINER_FAILED, run.err()
    err = run.err()
    assert "server1's actor is lost" in err and "launch.on_server_death=continue" in err
    assert "trainer1's actor is lost" in err
    run.assert_loopback_only()
    _assert_all_gone(started)
    done = max(r["step"] for r in run.steps())
    assert 3 <= done < 8
    # Re-running the same command resumes from the last checkpoint and finishes the run.
    again = RayRun(tmp_path, cfg, cluster.address)
    assert again.wait() == ExitCode.OK, again.err()
    steps = [r["step"] for r in again.steps()]
    assert steps[-1] == 8 and steps == sorted(steps)
    resumed = steps[len([s for s in steps if s <= done]):]
    assert resumed and resumed[0] <= done + 1, steps  # no step skipped after the resume
    assert all(r["rollout/n_trajectories"] == 16 for r in again.steps())
    _assert_all_gone(again.started())
