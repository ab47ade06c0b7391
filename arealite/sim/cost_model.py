"""The cost model of a simulated inference server: what one GPU server would take, in seconds.

A decode step of continuous batching reads every weight once and every KV-cache entry the
running batch holds, and does ``2 · params`` FLOPs per sequence; on today's GPUs it is
memory-bound until the batch is large, so

    step(B, K) = overhead + (weight_bytes + K · kv_bytes_per_token) / (HBM · mbu)
                 + 2 · params · B / (peak · mfu)

with ``B`` sequences running and ``K`` KV tokens held. A prefill is compute-bound:
``2 · params`` FLOPs per prompt token not found in the prefix cache. The KV cache holds
``(memory · mem_fraction − weight_bytes) / kv_bytes_per_token`` tokens. A weight update
moves ``weight_bytes`` at ``weight_gbps``. Response lengths are long-tailed: lognormal
around a median (capped at ``max_new_tokens``), or drawn from a file of observed lengths.

The numbers and their sources are in docs/scale.md. Everything here is pure arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["GPUS", "GPU_ALIASES", "MODELS", "GpuSpec", "ModelSpec", "SimSpec", "load_lengths"]


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator: dense bf16 peak, memory bandwidth and capacity."""

    peak_tflops: float
    hbm_gbps: float
    memory_gb: float


@dataclass(frozen=True)
class ModelSpec:
    """What the cost of a model depends on: parameters and the KV cache's shape."""

    params_b: float
    n_layers: int
    kv_heads: int
    head_dim: int

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.kv_heads * self.head_dim * 2  # K and V, bf16

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * 2  # bf16


#: Vendor datasheets (dense bf16 without sparsity; HBM bandwidth; memory).
GPUS = {
    "a100": GpuSpec(peak_tflops=312.0, hbm_gbps=2039.0, memory_gb=80.0),
    "h100": GpuSpec(peak_tflops=989.0, hbm_gbps=3350.0, memory_gb=80.0),
    "h200": GpuSpec(peak_tflops=989.0, hbm_gbps=4800.0, memory_gb=141.0),
    "l40s": GpuSpec(peak_tflops=362.0, hbm_gbps=864.0, memory_gb=48.0),
}

#: Other names of the cards above (lower case): the SXM H100 and H800 (same bf16 peak,
#: bandwidth and memory; the H800's NVLink is cut, which nothing here models).
GPU_ALIASES = {
    "h100-80gb": "h100", "h100-sxm": "h100", "h100-sxm5": "h100", "h800": "h100",
    "a100-80gb": "a100", "a100-sxm": "a100", "h200-141gb": "h200",
}

#: Models of AReaL's paper (DeepSeek-R1-Distill-Qwen, i.e. Qwen2.5 shapes), from their config.json.
MODELS = {
    "1.5b": ModelSpec(params_b=1.54, n_layers=28, kv_heads=2, head_dim=128),
    "7b": ModelSpec(params_b=7.62, n_layers=28, kv_heads=4, head_dim=128),
    "14b": ModelSpec(params_b=14.8, n_layers=48, kv_heads=8, head_dim=128),
    "32b": ModelSpec(params_b=32.8, n_layers=64, kv_heads=8, head_dim=128),
}


def load_lengths(path: str) -> tuple[int, ...]:
    """Response lengths, one positive integer per line (blank lines skipped)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"--sim-lengths-file {path!r} cannot be read: {e}") from None
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            n = int(line)
        except ValueError:
            raise ValueError(f"--sim-lengths-file {path}:{i}: {line.strip()!r} is not an integer length") from None
        if n < 1:
            raise ValueError(f"--sim-lengths-file {path}:{i}: length {n} must be at least 1")
        out.append(n)
    if not out:
        raise ValueError(f"--sim-lengths-file {path!r} holds no lengths (one integer per line)")
    return tuple(out)


@dataclass(frozen=True)
class SimSpec:
    """A simulated server: which GPU and model, how efficiently they run, how long answers are."""

    gpu: str = "h100"
    model: str = "7b"
    gpus_per_server: int = 1
    """Tensor-parallel GPUs of one server (bandwidth, FLOPs and memory add up)."""
    mem_fraction: float = 0.85
    """Share of GPU memory for weights and KV cache (SGLang's ``--mem-fraction-static``)."""
    mbu: float = 0.7
    """Achieved share of HBM bandwidth in decode."""
    mfu_decode: float = 0.3
    mfu_prefill: float = 0.5
    step_overhead_ms: float = 2.0
    """Scheduler and launch time of every batch step (SGLang without overlap scheduling)."""
    length_median: float = 512.0
    """Median response length in tokens (lognormal); ignored with ``lengths``."""
    length_sigma: float = 1.0
    """Spread of the lognormal (its log's standard deviation): 1.0 puts p99 at ~10x the median."""
    lengths: tuple[int, ...] = field(default=(), repr=False)
    """Observed response lengths to draw from (``--sim-lengths-file``); empty: the lognormal."""
    weight_gbps: float = 25.0
    """Bandwidth of one server's weight update (GB/s; e.g. NCCL over one 200 Gb/s NIC)."""
    time_scale: float = 1.0
    """Simulated seconds take this many real seconds (0.01: 100x faster than the GPU)."""
    gpu_shape: GpuSpec | None = None
    """A card given by its figures instead of ``gpu`` (the planner: a memory override)."""
    model_shape: ModelSpec | None = None
    """A model given by its shape instead of ``model`` (the planner: the run's own model)."""

    def __post_init__(self) -> None:
        if self.gpu_shape is None and self.gpu not in GPUS:
            raise ValueError(f"--sim-gpu {self.gpu!r} is not known (known: {', '.join(GPUS)})")
        if self.model_shape is None and self.model not in MODELS:
            raise ValueError(f"--sim-model {self.model!r} is not known (known: {', '.join(MODELS)})")
        for name in ("gpus_per_server", "mem_fraction", "mbu", "mfu_decode", "mfu_prefill", "length_median",
                     "weight_gbps", "time_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--sim-{name.replace('_', '-')} {getattr(self, name)} must be positive")
        if self.length_sigma < 0 or self.step_overhead_ms < 0:
            raise ValueError("--sim-length-sigma and --sim-step-overhead-ms must be >= 0")
        if self.kv_capacity_tokens < 1:
            raise ValueError(f"model {self.model} does not fit {self.gpus_per_server} x {self.gpu} at "
                             f"mem_fraction {self.mem_fraction}: raise --sim-gpus-per-server")

    @property
    def gpu_spec(self) -> GpuSpec:
        return self.gpu_shape or GPUS[self.gpu]

    @property
    def model_spec(self) -> ModelSpec:
        return self.model_shape or MODELS[self.model]

    @property
    def kv_capacity_tokens(self) -> int:
        g, m = self.gpu_spec, self.model_spec
        free = g.memory_gb * 1e9 * self.gpus_per_server * self.mem_fraction - m.weight_bytes
        return int(free // m.kv_bytes_per_token)

    # ---- time of one piece of work, in simulated seconds

    def _bandwidth(self) -> float:
        return self.gpu_spec.hbm_gbps * 1e9 * self.gpus_per_server * self.mbu

    def _flops(self, mfu: float) -> float:
        return self.gpu_spec.peak_tflops * 1e12 * self.gpus_per_server * mfu

    def step_base_s(self, batch: int) -> float:
        """A decode step of ``batch`` sequences, without the KV read."""
        m = self.model_spec
        return (self.step_overhead_ms / 1e3 + m.weight_bytes / self._bandwidth()
                + 2 * m.params_b * 1e9 * batch / self._flops(self.mfu_decode))

    def kv_s_per_token(self) -> float:
        """What each KV token held adds to a decode step."""
        return self.model_spec.kv_bytes_per_token / self._bandwidth()

    def step_s(self, batch: int, kv_tokens: int) -> float:
        return self.step_base_s(batch) + kv_tokens * self.kv_s_per_token()

    def steps_s(self, n: int, batch: int, kv_tokens: int) -> float:
        """``n`` decode steps in a row, the batch's KV growing by ``batch`` tokens a step."""
        c = self.kv_s_per_token()
        return n * (self.step_base_s(batch) + c * kv_tokens) + c * batch * n * (n - 1) / 2

    def steps_within(self, t: float, batch: int, kv_tokens: int) -> int:
        """The most whole decode steps that fit in ``t`` seconds (`steps_s` inverted)."""
        if t <= 0:
            return 0
        a = self.kv_s_per_token() * batch / 2
        b = self.step_base_s(batch) + self.kv_s_per_token() * kv_tokens - a
        n = t / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * t)) / (2 * a)
        n = max(0, int(n))
        while n > 0 and self.steps_s(n, batch, kv_tokens) > t:  # float rounding
            n -= 1
        return n

    def prefill_s(self, new_tokens: int) -> float:
        """One prefill forward over ``new_tokens`` prompt tokens (those the prefix cache lacks)."""
        m = self.model_spec
        return (self.step_overhead_ms / 1e3 + m.weight_bytes / self._bandwidth()
                + 2 * m.params_b * 1e9 * new_tokens / self._flops(self.mfu_prefill))

    def transfer_s(self, share: float = 1.0) -> float:
        """A weight update of ``share`` of the model's bytes."""
        return share * self.model_spec.weight_bytes / (self.weight_gbps * 1e9)

    # ---- response lengths

    def draw_length(self, rng: np.random.Generator) -> int:
        """One response length (before the request's ``max_new_tokens`` cap)."""
        if self.lengths:
            return int(self.lengths[int(rng.integers(len(self.lengths)))])
        mu = math.log(self.length_median)
        return max(1, int(round(math.exp(mu + self.length_sigma * float(rng.standard_normal())))))
