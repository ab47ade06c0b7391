"""The models a run trains and the engine that trains them: the actor (the policy, `actor`)
and the critic (the value model, `critic`), with their optimizers, LoRA adapters and the
simulated engine's cluster."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from arealite.config.section import Section


class OptimizerConfig(Section):
    type: Literal["adamw"] = "adamw"
    """Optimizer."""
    lr: float = Field(1e-6, gt=0)
    """Peak learning rate."""
    weight_decay: float = Field(0.01, ge=0)
    """Decoupled weight decay."""
    beta1: float = Field(0.9, ge=0, lt=1)
    """Adam beta1."""
    beta2: float = Field(0.999, ge=0, lt=1)
    """Adam beta2."""
    eps: float = Field(1e-8, gt=0)
    """Adam epsilon."""
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """LR schedule after warmup."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps from 0 to `lr`."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Final LR of the linear/cosine schedule, as a fraction of `lr`."""
    total_steps: int | None = Field(None, ge=1)
    """Steps of the schedule (None = set by the training script from the data)."""
    gradient_clipping: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this (0 = no clipping)."""


class SimTrainOptions(Section):
    """A simulated train engine's cluster (`actor.backend: sim`; docs/scale.md)."""

    gpu: Literal["a100", "h100", "h800", "h200"] = "h800"
    """The training GPUs (their dense bf16 peak)."""
    model: Literal["1.5b", "7b", "14b", "32b"] = "7b"
    """The model size trained (parameters)."""
    n_gpus: int = Field(8, ge=1)
    """Training GPUs; a step's FLOPs are spread over all of them."""
    mfu: float = Field(0.4, gt=0, le=1)
    """Achieved share of peak FLOPs in training."""


class LoraConfig(Section):
    rank: int = Field(16, ge=1)
    """LoRA rank r: each adapted weight W [out, in] gets B [out, r] @ A [r, in]."""
    alpha: float = Field(32.0, gt=0)
    """LoRA alpha: the update is scaled by `alpha / rank`."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input in training (PEFT's `lora_dropout`). Keep 0 with decoupled
    PPO: the proximal log-probs come from the training forward, which must score as `forward`."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1)
    """Names of the linear modules to adapt (the last part of the module path, e.g. `q_proj`);
    every name must match a linear layer of the model (the engine lists them otherwise)."""
    served_name: str = Field("policy", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """The name the inference servers serve the adapter under: every request's `lora_path`.
    Each push unloads it and loads the new adapter under the same name while generation is
    paused, so every trainer rank's client knows it from the config alone."""

    @field_validator("target_modules")
    @classmethod
    def _distinct_names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
                raise ValueError(f"{name!r} is not a module name (letters, digits and '_', e.g. 'q_proj')")
        if len(set(v)) != len(v):
            raise ValueError(f"{v} names a module twice")
        return v


class TrainEngineConfig(Section):
    """Everything a train engine reads to train one model: where the model is, its compute dtype,
    optimizer, micro-batches, attention, parallel layout and memory savers. The actor's and the
    critic's sections are both one, so that the same keys mean the same in both
    (`actor.sp_size`, `critic.sp_size`); a new engine setting is declared here once."""

    model_path: str = ""
    """Hugging Face model directory to train (config.json, safetensors, tokenizer)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype of the parameters; `auto` = bfloat16 on CUDA, float32 on CPU. Master
    weights, optimizer state and the gradient reduction over ranks stay float32."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """Optimizer and LR schedule."""
    mb_max_tokens: int = Field(8192, ge=1)
    """Token budget of one packed micro-batch."""
    attn_impl: Literal["auto", "varlen", "flex", "sdpa_loop"] = "auto"
    """Attention over the sequences of a packed micro-batch: `varlen` (torch's FlashAttention
    varlen kernel, one kernel per layer; CUDA with bfloat16/float16 compute only), `flex` (flex
    attention with a document-causal block mask: compiled on CUDA, torch's unfused reference
    kernel on CPU), `sdpa_loop` (one SDPA call per run of equal-length sequences; runs anywhere),
    `auto` = `varlen` where it can run, else `sdpa_loop` (faster than `flex` on CPU). A choice
    that cannot run on the engine's device is refused at start (see docs/training.md)."""
    dp_replicate: int = Field(1, ge=1)
    """Hybrid sharding (HSDP): the data-parallel ranks form this many replicas; FSDP2 shards the
    parameters within a replica and replicates them across replicas, so that the all-gathers and
    reduce-scatters stay within a replica (a node) and only one gradient all-reduce crosses them.
    1 = every rank shards (plain FSDP2). The world size must divide by it x `sp_size` x `tp_size`.
    See docs/training.md."""
    sp_size: int = Field(1, ge=1)
    """Ulysses sequence parallelism: each packed micro-batch is split by tokens over this many
    ranks, with an all-to-all over attention heads around attention (the world size must be a
    multiple). Lets one long answer's activations spread over several devices. Needs the
    attention heads divisible by it x `tp_size` (KV heads are repeated when fewer). See
    docs/training.md."""
    tp_size: int = Field(1, ge=1)
    """Tensor parallelism: the attention and MLP projections of each decoder layer are split over
    this many neighbouring ranks (FSDP2 shards over the data ranks), for Llama/Qwen2/Qwen3/Mistral
    and Qwen3-MoE models; heads, KV heads and the MLP width must divide by it. Composes with
    `sp_size` (Ulysses over each rank's heads), `ep_size` and `dp_replicate`; not with LoRA. See
    docs/training.md."""
    ep_size: int = Field(1, ge=1)
    """Expert parallelism for a mixture-of-experts model: each MoE layer's experts are split over
    this many ranks (an expert x data mesh), tokens go to their experts' ranks and back by
    all-to-all; FSDP2 shards the rest. The experts per layer and the world size must divide by
    it; its ranks are drawn from the data x sequence ranks (world / (`dp_replicate` x `tp_size`) must
    divide by it). Composes with `sp_size`, `tp_size` and `dp_replicate`; not with LoRA. See
    docs/moe.md."""
    router_aux_loss_coef: float = Field(0.0, ge=0)
    """Weight of a mixture-of-experts router's load-balancing loss (Switch-style, 1 when balanced,
    mean over MoE layers) added to the training loss; 0 = off, as the peers run RL. See docs/moe.md."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    cpu_offload: bool = False
    """Offload parameters and gradients to CPU (FSDP2 CPUOffloadPolicy)."""
    freeze_vision: bool = False
    """A vision-language model: train its language model only; the vision tower keeps its
    weights (no gradient, no optimizer state). See docs/vision.md."""


class ActorConfig(TrainEngineConfig):
    """The trained policy: its train engine's settings, and what only the policy has."""

    temperature: float | None = Field(None, gt=0)
    """Temperature used to recompute log-probs (None = `generation.temperature`)."""
    lora: LoraConfig | None = None
    """LoRA adapters (PEFT) instead of full fine-tuning: only the adapters train, have optimizer
    state and are pushed to the servers (see docs/lora.md); null = full fine-tuning."""
    backend: Literal["fsdp", "sim"] = "fsdp"
    """`fsdp` trains the model; `sim` simulates a GPU cluster's training time (`actor.sim`,
    docs/scale.md) and pushes `model_path`'s small tensors in place of the simulated model's."""
    sim: SimTrainOptions = Field(default_factory=SimTrainOptions)
    """Options used only when `backend` is `sim`."""


class CriticConfig(TrainEngineConfig):
    """PPO's value model: its train engine's settings (every key of `actor`'s engine, with the
    critic's own defaults where they differ), whether it trains, and its loss's clip."""

    model_path: str | None = None
    """Hugging Face model directory of the critic's backbone (None = `actor.model_path`); a
    scalar value head is added on top."""
    optimizer: OptimizerConfig = Field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    """The critic's own optimizer and LR schedule."""
    enabled: bool = False
    """Train a value model (PPO with a critic); needed by, and only used with, `algorithm.adv_estimator: gae`."""
    value_clip: float | None = Field(0.2, gt=0)
    """Clip range of the value update around the old values (PPO2's clipped value loss); null = unclipped."""
