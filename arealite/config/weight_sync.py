"""How new weights reach the inference servers (`weight_sync`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from arealite.config.section import Section


#: SGLang's pause modes (`pause_generation`'s ``mode``), as `weight_sync.pause_mode` names them.
PAUSE_MODES = ("abort", "retract", "in_place")
PauseMode = Literal["abort", "retract", "in_place"]


class WeightSyncConfig(Section):
    method: Literal["distributed", "disk", "shm", "tensor"] = "distributed"
    """`distributed`: broadcast over a process group (gloo on CPU, NCCL on CUDA); `disk`: safetensors directory;
    `shm`: one shared-memory file reused by every update (embedded servers on the trainer's host only; fastest there);
    `tensor`: tensor handles through `/update_weights_from_tensor` (shared memory on CPU, CUDA IPC on GPUs; embedded
    or SGLang servers on the trainer's host only; the colocated placement's push)."""
    bucket_size_mb: float = Field(64.0, gt=0)
    """Tensors are sent in buckets of about this size."""
    pause_mode: PauseMode = "in_place"
    """How the servers pause for an update (SGLang's `pause_generation` mode). `in_place`: answers in
    flight freeze with their KV cache and decode on under the new weights after the update (each token
    keeps the version that sampled it; the cache is not flushed, the old KV stays); `retract`: they go
    back to the servers' queues and their KV is recomputed under the new weights; `abort`: they are cut,
    returned and resubmitted by the client. Default measured in docs/scale.md."""
    verify_n_tensors: int = Field(2, ge=0)
    """Tensors read back with `get_weights_by_name` after each update and compared (on servers whose
    model class can read weights back; SGLang cannot for Qwen2, for example)."""
    probe: bool = True
    """After each update, every server scores a fixed token sequence and must agree with the trainer's
    forward (the log-prob probe; works on every model). Logs `probe_mean_abs_diff`, `probe_max_abs_diff`
    and `probe_k3` every step: the train/inference mismatch."""
    probe_every: int = Field(1, ge=1)
    """Run the probe on every this-many-th version (it costs a forward on each side)."""
    probe_tokens: int = Field(32, ge=2)
    """Length of the probe's token sequence (the first training prompt, padded with seeded ids)."""
    probe_tolerance: float | None = Field(None, gt=0)
    """Largest mean absolute log-prob difference a server may show on the probe (None = 1e-3 for
    float32 servers, 5e-2 for bfloat16/float16 ones)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend for the distributed method (auto = nccl on CUDA, else gloo)."""
    timeout_s: float = Field(120.0, gt=0)
    """Timeout of one weight update, and of the embedded servers' weight-update group (a server still
    receiving from a group whose member died stays stuck that long: SGLang's scheduler does the same
    until its own collective timeout)."""
    disk_dir: str | None = None
    """Scratch directory of the disk method (None = under the run directory)."""
    shm_dir: str = "/dev/shm"
    """Directory of the shm method's weight file (a tmpfs, so that it lives in RAM)."""
    shm_alias: bool = True
    """shm method: the servers serve straight out of the trainer's files (no copy on their side; two files,
    written in turn); false: one file the servers copy out of at each update."""
