"""A simulated train engine: the train-engine contract with a GPU cluster's cost model.

It trains nothing. A call takes the time the configured cluster would take, as a real-time
sleep scaled by ``server.sim.time_scale``:

    train_batch:  6 · params · tokens / (mfu · peak · n_gpus)   (forward + backward)
    forward:      2 · params · tokens / (mfu · peak · n_gpus)   (log-prob recomputation)

``tokens`` are the real tokens of the batch (its attention mask), so the time follows the
simulated answers' lengths. Everything around it is real: versions, checkpoints (a small
``torch.save`` file of the engine's state, so a run resumes) and the weight push, which goes
through the real `WeightPublisher`: the weights it reads are the small model of
``actor.model_path`` standing for the simulated one, and the simulated servers hold
generation for the simulated model's bytes at their ``weight_gbps`` (docs/scale.md).

``forward`` scores a token with the log-prob the server returned for it (``batch["logprobs"]``):
the simulated policy is the servers' policy, so importance ratios are 1 unless the batch
is stale.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from arealite.api.contracts import LossFn, LossWeightFn, PostHook, TrainBatch
from arealite.utils.buckets import buckets_of

from .cost_model import GPUS, MODELS, GpuSpec

logger = logging.getLogger("arealite.sim")

__all__ = ["SimTrainEngine", "step_seconds", "train_gpu"]

STATE_FILE = "sim_engine_state.pt"


def train_gpu(name: str) -> GpuSpec:
    """The GPU preset by name; ``h800`` is an H100 SXM with NVLink cut to 400 GB/s: the same
    989 TFLOP/s of dense bf16 (NVIDIA's H800 datasheet), which is all the training cost uses."""
    key = "h100" if name == "h800" else name
    if key not in GPUS:
        raise ValueError(f"actor.sim.gpu={name!r} is not a known GPU; use one of {sorted([*GPUS, 'h800'])}")
    return GPUS[key]


def step_seconds(tokens: int, params_b: float, flops_per_param_token: float, gpu: GpuSpec,
                 n_gpus: int, mfu: float) -> float:
    """Seconds a cluster of ``n_gpus`` takes for ``flops_per_param_token · params · tokens`` FLOPs."""
    return flops_per_param_token * params_b * 1e9 * tokens / (mfu * gpu.peak_tflops * 1e12 * n_gpus)


class SimTrainEngine:
    """The `TrainEngine` contract over the cost model above (see the module docstring).

    ``options`` is `actor.sim` (gpu, model, n_gpus, mfu); ``model_path`` the small model whose
    tensors stand for the simulated one in the weight push; ``time_scale`` is
    ``server.sim.time_scale``.
    """

    def __init__(self, options, model_path: str, time_scale: float = 1.0, frozen: bool = False):
        if options.model not in MODELS:
            raise ValueError(f"actor.sim.model={options.model!r} is not known; use one of {sorted(MODELS)}")
        self.options = options
        self.gpu = train_gpu(options.gpu)
        self.params_b = MODELS[options.model].params_b
        self.model_path = Path(model_path) if model_path else None
        self.time_scale = float(time_scale)
        self.frozen = frozen
        self.tensors: dict[str, torch.Tensor] = {}
        self._version = 0
        self._step = 0
        self.simulated_s = 0.0
        """Simulated GPU seconds spent so far (before ``time_scale``)."""

    # ------------------------------------------------------------------ life cycle

    def initialize(self, total_steps: int | None = None) -> SimTrainEngine:
        """Load the small model's tensors (the weights the push sends)."""
        del total_steps
        if self.model_path is None or not self.model_path.is_dir():
            raise ValueError(f"actor.model_path={str(self.model_path or '')!r} must be a model directory: the "
                             "simulated engine pushes its (small) tensors in place of the simulated model's")
        files = sorted(self.model_path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"actor.model_path={str(self.model_path)!r} holds no *.safetensors file")
        for f in files:
            self.tensors.update(load_file(str(f)))
        return self

    def destroy(self) -> None:
        self.tensors = {}

    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = int(version)

    @property
    def step_count(self) -> int:
        return self._step

    # ------------------------------------------------------------------ compute

    def _spend(self, tokens: int, flops_per_param_token: float) -> float:
        sim = step_seconds(tokens, self.params_b, flops_per_param_token, self.gpu, self.options.n_gpus,
                           self.options.mfu)
        self.simulated_s += sim
        if sim * self.time_scale > 0:
            time.sleep(sim * self.time_scale)
        return sim

    def train_batch(self, batch: TrainBatch, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> dict[str, float]:
        """One simulated optimizer step: forward + backward time of the batch's tokens."""
        del loss_fn, loss_weight_fn
        if self.frozen:
            raise RuntimeError("this SimTrainEngine is frozen (a reference model): it cannot train")
        mask = batch["attention_mask"]
        tokens = int(mask.sum())
        sim = self._spend(tokens, 6.0)
        self._step += 1
        return {"grad_norm": 0.0, "lr": 0.0, "loss": 0.0, "n_tokens": float(tokens),
                "n_tokens_computed": float(tokens), "n_seqs": float(mask.shape[0]), "n_mbs": 1.0,
                "skipped": 0.0, "sim_seconds": sim}

    @torch.no_grad()
    def forward(self, batch: TrainBatch, post_hook: PostHook, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Per-token log-probs ``[B, L]``: the servers' own (``batch["logprobs"]``), after the
        forward's simulated time."""
        del post_hook
        self._spend(int(batch["attention_mask"].sum()), 2.0)
        ids = batch["input_ids"]
        if "logprobs" in batch.keys():  # noqa: SIM118 (a TensorDict has no `in`)
            return batch["logprobs"].to(out_dtype).clone()
        return torch.zeros(ids.shape, dtype=out_dtype)

    # ------------------------------------------------------------------ checkpoints

    def save(self, path: str | os.PathLike) -> None:
        """The engine's state (version, steps, simulated time) in one small file under ``path``."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"version": self._version, "step": self._step, "simulated_s": self.simulated_s},
                   out / STATE_FILE)

    def load(self, path: str | os.PathLike) -> None:
        f = Path(path) / STATE_FILE
        if not f.is_file():
            raise FileNotFoundError(f"{f}: no simulated engine state here (was the checkpoint written by "
                                    "actor.backend=sim?)")
        state = torch.load(f, weights_only=True)
        self._version, self._step = int(state["version"]), int(state["step"])
        self.simulated_s = float(state["simulated_s"])

    def export_hf(self, path: str | os.PathLike, merged: bool = False) -> None:
        """The small model's directory (its config and tokenizer) with the engine's tensors."""
        del merged
        out = Path(path)
        shutil.copytree(self.model_path, out, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
        save_file({k: v.contiguous() for k, v in self.tensors.items()}, str(out / "model.safetensors"))

    def named_weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The small model's tensors in HF names, in buckets of at most ``bucket_bytes``."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0 (weight_sync.bucket_size_mb)")
        yield from buckets_of(iter(self.tensors.items()), bucket_bytes)
