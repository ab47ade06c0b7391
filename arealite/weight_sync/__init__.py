"""Weight sync: new trainer weights reach every inference server after each step.

    publisher = make_publisher(cfg, rollout, train_engine)
    publisher.init()                      # once, on every trainer rank
    timings = publisher.publish(v)        # after each training step, on every trainer rank
    publisher.close()

`publish` pauses the rollout side and the servers, moves the weights, verifies them,
sets version ``v`` on the train engine and the rollout side, and resumes
(`publisher.WeightPublisher`). `weight_sync.method` picks the transfer
(`make_transfer`): ``distributed`` (broadcast over a gloo/NCCL group; see
`distributed.py`), ``disk`` (safetensors directory; see `disk.py`) or ``shm`` (one
shared-memory file reused by every update, for embedded servers on the trainer's host;
see `shm.py`) or ``tensor`` (tensor handles, shared memory or CUDA IPC, for embedded or
SGLang servers on the trainer's machine; see `tensor.py`). A server that is gone (dead or hung: no answer to its health route) is
dropped from rotation and weight updates and the update goes on with the others; any
other failure, or no server left, raises `WeightSyncError` and leaves the servers paused.
"""

from __future__ import annotations

from collections.abc import Callable
import logging
from pathlib import Path

import torch

from arealite.api.contracts import (
    HeadOutput,
    Runner,
    TrainEngine,
    WeightSource,
    WeightTransfer,
    WeightUpdateAdmin,
    WeightUpdateTarget,
    require,
)
from arealite.weight_sync.base import (
    ReadbackSample,
    StateDictSource,
    WeightSyncError,
    compare_readback,
)
from arealite.config.cross_field_checks import config_advice
from arealite.weight_sync.disk import DiskTransfer
from arealite.weight_sync.distributed import DistributedTransfer
from arealite.weight_sync.fp8_push import Fp8Source, fp8_rounded_scorer
from arealite.weight_sync.lora_push import AdapterSource, LoraTransfer
from arealite.weight_sync.publisher import WeightPublisher
from arealite.weight_sync.shm import ShmTransfer
from arealite.weight_sync.tensor import TensorTransfer
from arealite.weight_sync.probe import LogprobProbe, default_probe_tolerance, probe_tokens
from arealite.weight_sync.verify import ReadbackVerifier, Verifiers, WeightVerifier
from arealite.vision.prompt import VisionPrompt

__all__ = [
    "DiskTransfer",
    "DistributedTransfer",
    "Fp8Source",
    "LoraTransfer",
    "LogprobProbe",
    "ReadbackSample",
    "ReadbackVerifier",
    "ShmTransfer",
    "TensorTransfer",
    "StateDictSource",
    "WeightPublisher",
    "WeightSource",
    "WeightSyncError",
    "Verifiers",
    "WeightVerifier",
    "compare_readback",
    "make_publisher",
    "make_verifier",
    "push_method",
    "make_transfer",
    "server_weight_dtype",
]

logger = logging.getLogger("arealite.weight_sync")

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


def push_method(config) -> str:
    """`weight_sync.method`; a colocated run that does not set it pushes by `tensor` (handles on
    the same machine: no disk, no process group, docs/placement.md)."""
    ws = config.weight_sync
    if config.launch.placement == "colocated" and "method" not in ws.model_fields_set:
        return "tensor"
    return ws.method


def make_transfer(config, admin: WeightUpdateAdmin, run: Runner,
                  model_path: str | None = None) -> WeightTransfer:
    """The transfer `config.weight_sync.method` asks for.

    `config` is the whole `ArealiteConfig`; `admin` the servers' administration;
    `run(coro)` runs an admin coroutine on the client's loop; `model_path` the trained
    model's directory (the disk transfer copies its ``config.json``).
    """
    ws = config.weight_sync
    dtype = server_weight_dtype(config)
    method = push_method(config)
    if method == "distributed":
        layout = "sglang" if config.launch.server_backend == "sglang" else "auto"
        return DistributedTransfer(ws, admin, run, wire_dtype=dtype, layout=layout)
    if method == "shm":
        return ShmTransfer(ws, admin, run, shm_dir=ws.shm_dir, server_dtype=dtype)
    if method == "tensor":
        return TensorTransfer(ws, admin, run, server_dtype=dtype)
    exp = config.experiment
    root = ws.disk_dir or str(Path(exp.output_root) / exp.name / exp.trial / "weight_sync")
    return DiskTransfer(ws, admin, run, root, model_path or config.actor.model_path or None,
                        server_dtype=dtype)


def make_lora_transfer(config, admin: WeightUpdateAdmin, run: Runner, engine) -> LoraTransfer:
    """The adapter push of a LoRA run: a PEFT directory per version under ``weight_sync.disk_dir``
    (or the run directory), loaded under ``actor.lora.served_name``, the name every client of
    the run sends (`arealite.rollout.build.build_inference_client`)."""
    exp, ws = config.experiment, config.weight_sync
    root = Path(ws.disk_dir or Path(exp.output_root) / exp.name / exp.trial / "weight_sync") / "lora"
    return LoraTransfer(ws, admin, run, root, engine.adapter_config(), server_dtype=server_weight_dtype(config),
                        name=config.actor.lora.served_name)


def engine_scorer(engine: TrainEngine, vision: VisionPrompt | None = None) -> Callable[[list[int]], list[float]]:
    """The trainer's log-probs (temperature 1) of ``ids[1:]``: the probe's forward (every rank);
    with ``vision``, of a prompt holding its images."""
    from tensordict import TensorDict

    def hook(head: HeadOutput, mb: dict) -> torch.Tensor:
        return head.logprobs(mb["labels"], 1.0)

    def score(ids: list[int]) -> list[float]:
        t = torch.tensor([ids], dtype=torch.long)
        data = {"input_ids": t, "attention_mask": torch.ones_like(t, dtype=torch.bool)}
        if vision is not None and vision.image_data:
            data.update(pixel_values=vision.pixel_values[None], image_grid_thw=vision.image_grid_thw[None])
        return engine.forward(TensorDict(data, batch_size=[1]), hook)[0, 1:].tolist()

    return score


def make_verifier(config, admin: WeightUpdateAdmin, transfer: WeightTransfer, train_engine: TrainEngine,
                  probe_prompt: list[int] | VisionPrompt | None = None) -> WeightVerifier:
    """Read-back (where the servers can) plus, unless ``weight_sync.probe`` is off, the log-prob
    probe (of ``probe_prompt``: its first ``weight_sync.probe_tokens`` tokens; a prompt with
    images whole, since an image's placeholders cannot be cut)."""
    ws = config.weight_sync
    dtype = lambda: getattr(transfer, "server_dtype", None)  # noqa: E731 - known once the transfer starts
    # A LoRA push sends adapter tensors, which no server can read back by name: the probe checks it.
    n_readback = 0 if isinstance(transfer, LoraTransfer) else ws.verify_n_tensors
    readback = ReadbackVerifier(admin, n_readback, dtype=dtype)
    if not ws.probe or not callable(getattr(admin, "score_prompt", None)):
        return readback
    tol = (lambda: ws.probe_tolerance) if ws.probe_tolerance is not None else (
        lambda: default_probe_tolerance(dtype()))
    vision = probe_prompt if isinstance(probe_prompt, VisionPrompt) and probe_prompt.image_data else None
    score = engine_scorer(train_engine, vision)
    if config.server.quantization == "fp8":  # the servers hold FP8-rounded weights: so does the probe's forward
        model = getattr(train_engine, "model", None)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"server.quantization=fp8: the log-prob probe rounds the train engine's model "
                            f"to FP8, but {type(train_engine).__name__} has no .model; set weight_sync.probe=false")
        score = fp8_rounded_scorer(model, score)
    if vision is not None:
        probe = LogprobProbe(admin, score, vision.input_ids, tol, ws.probe_every, image_data=vision.image_data)
        return Verifiers(readback, probe)
    if isinstance(probe_prompt, VisionPrompt):
        probe_prompt = probe_prompt.input_ids
    tokens = probe_tokens(probe_prompt, _vocab_size(train_engine), ws.probe_tokens, seed=config.experiment.seed)
    return Verifiers(readback, LogprobProbe(admin, score, tokens, tol, ws.probe_every))


def _vocab_size(engine: TrainEngine) -> int:
    cfg = getattr(getattr(engine, "model", None), "config", None)
    return int(getattr(cfg, "vocab_size", 0) or 256)


def make_publisher(config, rollout: WeightUpdateTarget, train_engine: TrainEngine, *,
                   source: WeightSource | None = None, probe_prompt: list[int] | VisionPrompt | None = None,
                   after_read: Callable[[], None] | None = None) -> WeightPublisher:
    """The publisher of a run: `train_engine`'s weights to the servers of `rollout`.

    `config` is the whole `ArealiteConfig`; `rollout` the rollout side (`RolloutSide`),
    whose ``admin`` administers the servers and whose ``run`` runs those calls on its
    client's loop; it is paused around each update. The train engine and the rollout side
    get the new version. `source` overrides what is read (default: the engine);
    `probe_prompt` gives the log-prob probe real tokens (e.g. the first training prompt);
    `after_read` runs on every rank once the weights are read (`WeightPublisher`).
    """
    require(rollout, WeightUpdateTarget, "the rollout side of a weight publisher")
    admin, run = rollout.admin, rollout.run
    require(admin, WeightUpdateAdmin, "the rollout side's admin")
    model_path = getattr(getattr(train_engine, "config", None), "model_path", None)
    if config.actor.lora is not None:  # only the adapter travels (`lora_push.LoraTransfer`)
        transfer = make_lora_transfer(config, admin, run, train_engine)
        source = source if source is not None else AdapterSource(train_engine)
    else:
        transfer = make_transfer(config, admin, run, model_path)
    source = source if source is not None else train_engine
    if config.server.quantization == "fp8":  # quantised on the push, bucket by bucket (`fp8_push`)
        source = Fp8Source(source)
    for advice in config_advice(config):
        logger.warning(advice)
    verifier = make_verifier(config, admin, transfer, train_engine, probe_prompt)
    return WeightPublisher(transfer, source, admin, run,
                           parties=[train_engine], controller=rollout, verifier=verifier, after_read=after_read)
