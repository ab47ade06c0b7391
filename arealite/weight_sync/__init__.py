"""Weight sync: new trainer weights reach every inference server after each step.

    sync = make_weight_sync(cfg, client, engine, controller.run)
    sync.init()                      # once, on every trainer rank
    timings = sync.push(engine, v)   # after each training step, on every trainer rank
    sync.close()

`weight_sync.method` picks the transport: ``distributed`` (broadcast over a
gloo/NCCL group; see `distributed.py`), ``disk`` (safetensors directory; see
`disk.py`) or ``shm`` (one shared-memory file reused by every update, for
embedded servers on the trainer's host; see `shm.py`). A server that is gone (dead or hung: no answer to ``/health``) is
dropped from rotation and weight updates and the push goes on with the others;
any other failure, or no server left, raises `WeightSyncError` and leaves the
servers paused.
"""

from __future__ import annotations

from pathlib import Path

import torch

from arealite.weight_sync.base import (
    ReadbackSample,
    StateDictSource,
    WeightSource,
    WeightSyncError,
    compare_readback,
)
from arealite.weight_sync.disk import DiskWeightSync
from arealite.weight_sync.distributed import DistributedWeightSync
from arealite.weight_sync.shm import ShmWeightSync

__all__ = [
    "DiskWeightSync",
    "DistributedWeightSync",
    "ReadbackSample",
    "ShmWeightSync",
    "StateDictSource",
    "WeightSource",
    "WeightSyncError",
    "compare_readback",
    "make_weight_sync",
    "server_weight_dtype",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def server_weight_dtype(config) -> torch.dtype | None:
    """The dtype the servers hold weights in, from `server.dtype` (None = the checkpoint's).

    `auto` means the checkpoint's dtype for the embedded server on CPU and
    bfloat16 for SGLang (the launcher passes ``--dtype bfloat16`` to it).
    """
    if config.server.dtype in _DTYPES:
        return _DTYPES[config.server.dtype]
    if config.launch.server_backend == "sglang":
        return torch.bfloat16
    return None


def make_weight_sync(config, client, train_engine, run):
    """Build the weight sync `config.weight_sync.method` asks for.

    `config` is the whole `ArealiteConfig`; `client` an initialized
    ``RemoteSGLangEngine``; `train_engine` the trainer's engine (its model path
    and weights); `run(coro)` runs a client coroutine on the client's loop and
    returns its result (``RolloutController.run``).
    """
    ws = config.weight_sync
    dtype = server_weight_dtype(config)
    if ws.method == "distributed":
        layout = "sglang" if config.launch.server_backend == "sglang" else "auto"
        return DistributedWeightSync(ws, client, run, wire_dtype=dtype, layout=layout)
    if ws.method == "shm":
        return ShmWeightSync(ws, client, run, shm_dir=ws.shm_dir, server_dtype=dtype)
    exp = config.experiment
    root = ws.disk_dir or str(Path(exp.output_root) / exp.name / exp.trial / "weight_sync")
    model_path = getattr(getattr(train_engine, "config", None), "model_path", None)
    return DiskWeightSync(ws, client, run, root, model_path or config.actor.model_path or None,
                          server_dtype=dtype)
