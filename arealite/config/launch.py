"""Which processes the launchers start and where: local (`launch`), on a Ray cluster
(`launch.ray`), in a Slurm batch job (`launch.slurm`).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from arealite.config.section import Section


def check_server_addr(addr: str) -> str:
    """`host:port` with a port in 1..65535 (IPv6 hosts in brackets: `[::1]:30000`)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{addr!r} is not `host:port` with a port in 1..65535 (e.g. 127.0.0.1:30000)")
    return addr


_RESOURCE_NAME_RE = re.compile(r"^[A-Za-z0-9_.:/-]+$")


def _check_resources(v: dict[str, float]) -> dict[str, float]:
    for name, amount in v.items():
        if name in ("CPU", "GPU", "memory") or not _RESOURCE_NAME_RE.match(name):
            raise ValueError(f"{name!r} is not a custom resource name (CPUs and GPUs have their own fields)")
        if amount <= 0:
            raise ValueError(f"{name}: {amount} must be > 0")
    return v


class RayLaunchConfig(Section):
    """Placement of a run on an existing Ray cluster (`python -m arealite.launcher.ray`)."""

    address: str = Field("auto", min_length=1)
    """Ray cluster to join: `auto` (the RAY_ADDRESS variable, else the cluster `ray start` started on
    this machine) or the `host:port` of its head node."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """How long to try reaching the cluster's head node before giving up."""
    server_cpus: float = Field(1.0, gt=0)
    """CPUs reserved for each inference server."""
    server_gpus: float | None = Field(None, ge=0)
    """GPUs reserved for each inference server (None: `server.sglang.tp_size` with SGLang, 0 with the
    embedded server)."""
    trainer_cpus: float = Field(1.0, gt=0)
    """CPUs reserved for each trainer rank (`launch.n_trainer_procs` ranks in all)."""
    trainer_gpus: float = Field(0.0, ge=0)
    """GPUs reserved for each trainer rank (1 on a GPU cluster)."""
    server_resources: dict[str, float] = Field(default_factory=dict)
    """Custom node resources each server needs, e.g. `{inference_node: 1}` to keep servers on the nodes
    started with `ray start --resources '{"inference_node": 8}'`."""
    trainer_resources: dict[str, float] = Field(default_factory=dict)
    """Custom node resources each trainer rank needs."""
    separate_nodes: bool = False
    """Never place a trainer rank on a node that runs a server (inference and training on distinct nodes)."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement-group strategy within each role (servers; trainer ranks). PACK keeps the trainer
    ranks on as few nodes as possible."""
    placement_timeout_s: float = Field(120.0, gt=0)
    """How long to wait for the cluster to grant the placement groups."""

    @field_validator("server_resources", "trainer_resources")
    @classmethod
    def _resources(cls, v: dict[str, float]) -> dict[str, float]:
        return _check_resources(v)


class SlurmLaunchConfig(Section):
    """The batch job `python -m arealite.launcher.slurm` writes and submits."""

    trainer_nodes: int = Field(1, ge=1)
    """Nodes of the trainer (`torchrun --nnodes`); `launch.n_trainer_procs` must divide evenly among them."""
    server_nodes: int = Field(0, ge=0)
    """Nodes for the inference servers alone (0: the servers run on the trainer nodes)."""
    partition: str | None = None
    """`sbatch --partition` (None: the cluster's default)."""
    account: str | None = None
    """`sbatch --account` (None: the user's default)."""
    time_limit: str | None = None
    """`sbatch --time`, e.g. `24:00:00` (None: the partition's default)."""
    gpus_per_node: int = Field(0, ge=0)
    """`sbatch --gpus-per-node` (0: no GPU request, for CPU runs)."""
    cpus_per_node: int | None = Field(None, ge=1)
    """CPUs per node requested (`--cpus-per-task` of the job's single task per node; None: the default)."""
    rendezvous_port: int = Field(29500, ge=1, le=65535)
    """Port of the trainers' torchrun rendezvous on the first trainer node."""
    sbatch_args: list[str] = Field(default_factory=list)
    """Extra `#SBATCH` lines, verbatim (e.g. `--exclusive`, `--mem=0`)."""


class TimeSharingConfig(Section):
    """The turns trainer and servers take on the same GPUs (`launch.placement: colocated`)."""

    memory_timeout_s: float = Field(120.0, gt=0)
    """How long one release or resume of the servers' memory may take before it counts as failed."""
    resume_attempts: int = Field(3, ge=1)
    """How many times a failed resume of the servers' memory is tried before the run stops with an
    error naming the servers that did not come back."""
    offload: bool = True
    """Park the trainer's parameters, gradients and optimizer state in host memory while the servers
    generate (`false`: keep them on the device, for a model small enough to fit beside the servers)."""


class LaunchConfig(Section):
    placement: Literal["disaggregated", "colocated", "shared"] = "disaggregated"
    """Where trainer and servers run (docs/placement.md). `disaggregated`: on GPUs of their own,
    generation overlapping training. `colocated` (time-shared): every trainer rank's GPU also hosts a
    server share; per step the servers generate, release their weights and KV cache, the trainer
    loads its state, trains, pushes, offloads, and the servers resume (synchronous:
    `rollout.max_head_offpolicyness` 0). `shared` (space-shared): both resident on the same GPUs with
    a memory split (`server.sglang.mem_fraction_static` for the servers, the rest for the trainer),
    overlapping as disaggregated. One GPU or N: `launch.n_trainer_procs` ranks, one per GPU, and
    `launch.n_servers` x `server.sglang.tp_size` = that many server GPUs."""
    time_sharing: TimeSharingConfig = Field(default_factory=TimeSharingConfig)
    """Timeouts, retries and offload of `placement: colocated`."""
    n_servers: int = Field(1, ge=0)
    """Number of inference servers the local launcher starts (0 = use `server_addrs`)."""
    server_backend: Literal["embedded", "sglang", "sim"] = "embedded"
    """`embedded` (arealite's CPU/GPU server in PyTorch), `sglang` (GPU inference engine) or `sim`
    (the embedded server's protocol with a GPU cost model instead of the model, `server.sim`;
    docs/scale.md)."""
    server_addrs: list[str] = Field(default_factory=list)
    """Addresses `host:port` of servers started outside the launcher. Also read from
    the environment variable AREALITE_SERVER_ADDRS (comma-separated)."""
    n_trainer_procs: int = Field(1, ge=1)
    """Number of trainer processes `torchrun` starts (one per GPU on CUDA)."""
    gpus: str | None = None
    """The cluster's GPUs, e.g. `8xH100`, `2x8xH100` (nodes x per node), `H200`: with it, the config
    check predicts every trainer rank's and server's memory on that card and refuses a layout that
    will not fit, naming the cheapest change that does (`python -m arealite.plan` shows the whole
    plan). None = no memory check. See docs/planning.md."""
    gpu_memory_gib: float | None = Field(None, gt=0)
    """The memory of one of `gpus` in GiB when it differs from the named card's (None = the card's)."""
    memory_check: Literal["error", "warn", "off"] = "error"
    """What a predicted out-of-memory does when `gpus` is set: refuse the config (`error`), log a
    warning (`warn`) or nothing (`off`)."""
    server_startup_timeout_s: float = Field(300.0, gt=0)
    """How long to wait for every server's `/health` before giving up."""
    server_cpus: int | None = Field(None, ge=1)
    """Pin processes to CPU cores (Linux): this many of the launcher's cores go to the
    servers it starts (split evenly between them), the others to the trainer processes.
    Keeps inference and training from taking each other's cores when they run at the
    same time (asynchronous RL on a CPU machine). `null`: no pinning."""
    trainer_env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for the trainer processes."""
    on_server_death: Literal["continue", "stop"] = "continue"
    """What the launcher does when one of its servers dies mid-run: `continue` logs it and
    goes on with the others (the trainer drops it from rotation and weight updates; the
    last one dying still stops the run, exit 3); `stop` ends the run at once (exit 3)."""
    cluster_bind: Literal["node_ip", "all_interfaces"] = "node_ip"
    """Ray and Slurm launchers: where servers bind. `node_ip`: each node's own IP (what Ray reports, or the
    host's outgoing interface under Slurm); `all_interfaces`: 0.0.0.0. Either way every address handed
    to another process (servers, the trainers' rendezvous, the weight-update group's store) is the node's
    IP. The local launcher binds `server.host` (127.0.0.1) instead."""
    ray: RayLaunchConfig = Field(default_factory=RayLaunchConfig)
    """Placement on a Ray cluster (`python -m arealite.launcher.ray`)."""
    slurm: SlurmLaunchConfig = Field(default_factory=SlurmLaunchConfig)
    """The Slurm batch job (`python -m arealite.launcher.slurm`)."""

    @field_validator("server_addrs")
    @classmethod
    def _addrs(cls, v: list[str]) -> list[str]:
        for addr in v:
            check_server_addr(addr)
        return v

    @field_validator("trainer_env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
                raise ValueError(
                    f"{name!r} is not a valid environment variable name "
                    "(letters, digits and '_', not starting with a digit)"
                )
        return v
