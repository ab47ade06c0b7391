"""The Slurm launcher: the batch script it writes (always), and a real job on a one-node
Slurm cluster that the test starts on localhost (Debian's slurm-wlm: munged, slurmctld,
slurmd), skipped where those programs are not installed."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from arealite.config.schema import ArealiteConfig
from arealite.launcher.slurm import check_slurm, sbatch_script, write_job
from conftest import free_port, run_env


def _cfg(**sections) -> ArealiteConfig:
    return ArealiteConfig.model_validate({"actor": {"model_path": "/m"}, **sections})


def test_script_has_one_step_per_role_a_rendezvous_and_teardown(tmp_path):
    cfg = _cfg(launch={"n_servers": 4, "n_trainer_procs": 8, "on_server_death": "stop",
                       "slurm": {"trainer_nodes": 2, "server_nodes": 2, "partition": "gpu", "gpus_per_node": 8,
                                 "time_limit": "1:00:00", "sbatch_args": ["--exclusive"], "rendezvous_port": 29999}})
    text = sbatch_script(cfg, "arealite.train", str(tmp_path / "c.yaml"), ["actor.optimizer.lr=1e-5",
                                                                          "server.api_key=hidden"], tmp_path)
    head = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    for line in ("--nodes=4", "--partition=gpu", "--gpus-per-node=8", "--time=1:00:00", "--exclusive"):
        assert f"#SBATCH {line}" in head
    servers = text[text.index("srun --nodes=2 --ntasks=4"):]
    assert "--kill-on-bad-exit=1" in servers.split("&")[0]  # on_server_death=stop
    assert 'NODES[*]:2:2' in text  # the server nodes come after the two trainer nodes
    assert "--nnodes 2 --nproc_per_node 4 --rdzv_backend c10d" in text
    assert '--rdzv_endpoint "$RDZV_HOST:29999"' in text and "-m arealite.train" in text
    assert "trainer%n.log" in text and "server%t.log" in text
    assert "trap stop_steps EXIT" in text and "kill -KILL" in text
    assert "hidden" not in text and "actor.optimizer.lr=1e-5" in text
    bash = shutil.which("bash")
    assert subprocess.run([bash, "-n"], input=text, text=True).returncode == 0  # valid shell


def test_key_goes_in_a_private_file_and_bad_layouts_name_the_fields(tmp_path):
    cfg = _cfg(server={"api_key": "sk-123"})
    path = write_job(cfg, "arealite.train", None, [], tmp_path / "run")
    key = tmp_path / "run" / "slurm" / "api_key"
    assert key.read_text() == "sk-123" and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert "sk-123" not in path.read_text() and f"cat {key}" in path.read_text()
    with pytest.raises(ValueError, match="launch.n_trainer_procs=3.*launch.slurm.trainer_nodes=2"):
        check_slurm(_cfg(launch={"n_trainer_procs": 3, "slurm": {"trainer_nodes": 2}}))
    with pytest.raises(ValueError, match="launch.slurm.server_nodes=2"):
        check_slurm(_cfg(launch={"n_servers": 1, "slurm": {"server_nodes": 2}}))


# ---------------------------------------------------------------- a real one-node Slurm

DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """slurmctld and slurmd on localhost with a throw-away config; SLURM_CONF points at it."""
    if not all(os.path.exists(d) for d in DAEMONS) or not shutil.which("sbatch") or os.geteuid() != 0:
        pytest.skip("needs Debian's slurm-wlm (apt-get install slurm-wlm) and root")
    d = tmp_path_factory.mktemp("slurm")
    host = socket.gethostname()
    conf = d / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=arealite", f"SlurmctldHost={host}(127.0.0.1)", "SlurmUser=root", "SlurmdUser=root",
        f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}", f"StateSaveLocation={d}",
        f"SlurmdSpoolDir={d}/spool", f"SlurmctldPidFile={d}/ctld.pid", f"SlurmdPidFile={d}/d.pid",
        f"SlurmctldLogFile={d}/ctld.log", f"SlurmdLogFile={d}/d.log", "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "ReturnToService=2", "MpiDefault=none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES", ""]))
    env = dict(os.environ, SLURM_CONF=str(conf))
    started = []
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
        Path("/run/munge").mkdir(exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", DAEMONS[0]], check=True)
    for daemon in DAEMONS[1:]:
        subprocess.run([daemon, "-c"], env=env, check=True)
    for pid_file in ("ctld.pid", "d.pid"):
        deadline = time.monotonic() + 10
        while not (d / pid_file).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        started.append(int((d / pid_file).read_text()))
    deadline = time.monotonic() + 30
    while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                                       text=True).stdout:
        assert time.monotonic() < deadline, (d / "ctld.log").read_text()[-2000:]
        time.sleep(0.5)
    yield env
    for pid in started:
        os.kill(pid, signal.SIGTERM)


def _job(tmp_path: Path, demo: Path, slurm_env: dict, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    cfg = {
        "experiment": {"name": "slurm", "trial": "t", "output_root": str(tmp_path / "runs")},
        "launch": {"n_servers": 2, "n_trainer_procs": 2, "server_startup_timeout_s": 120},
        "rollout": {"consumer_batch_size": 4, "max_head_offpolicyness": 1},
        "generation": {"n_samples": 4, "max_new_tokens": 8},
        "actor": {"model_path": str(demo / "model")},
        "data": {"train_path": str(demo / "train.jsonl"), "eval_path": None, "max_train_steps": 2,
                 "reward_fn": "arealite.reward.reverse_digits:reverse_digits_reward"},
        "saver": {"export_hf_at_end": False}, "stats": {"progress_bar": False, "plot": False},
        "weight_sync": {"bucket_size_mb": 0.05},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    # Loopback only: the servers bind (and advertise) AREALITE_HOST_IP instead of the interface
    # address, and gloo stays on `lo` (sbatch exports the environment to every step).
    env = run_env(AREALITE_HOST_IP="127.0.0.1", GLOO_SOCKET_IFNAME="lo",
                  **{k: v for k, v in slurm_env.items() if k == "SLURM_CONF"})
    res = subprocess.run([sys.executable, "-m", "arealite.launcher.slurm", "--config", str(tmp_path / "cfg.yaml"),
                          "--wait", *extra], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    return res, tmp_path / "runs" / "slurm" / "t"


@pytest.mark.slow
def test_a_real_slurm_job_trains_and_cleans_up(slurm, tmp_path, micro_demo_dir):
    res, run = _job(tmp_path, micro_demo_dir, slurm, "server.api_key=sk-slurm-test")
    logs = run / "logs"
    assert res.returncode == 0, res.stderr[-2000:] + "".join(p.read_text()[-2000:] for p in logs.glob("*"))
    steps = [ln for ln in (run / "stats.jsonl").read_text().splitlines() if "rollout/reward_mean" in ln]
    assert len(steps) == 2
    assert {p.name for p in logs.glob("*.log")} == {"server0.log", "server1.log", "trainer0.log"}
    for p in logs.glob("*"):
        assert "sk-slurm-test" not in p.read_text(errors="replace"), p
    assert "joined weight-update group" in (logs / "server0.log").read_text()
    addrs = [p.read_text().strip() for p in (run / "slurm").glob("addrs.*/server*")]
    assert len(addrs) == 2 and all(a.startswith("127.0.0.1:") for a in addrs), addrs
    # Nothing of the job is left running.
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not left, left
