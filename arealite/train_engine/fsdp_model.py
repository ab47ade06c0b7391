"""Building what ``FSDPEngine`` trains: the HF model sharded with FSDP2, AdamW and its LR schedule.

The model loads with fp32 master weights (``actor.dtype`` only sets the compute
dtype, through FSDP's mixed-precision policy), without dropout, with the packed-sequence
attention ``actor.attn_impl`` chooses (``arealite.train_engine.attention``), and every
decoder layer sharded on its own (then the root), as FSDP2 recommends.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from arealite.config.schema import OptimizerConfig, TrainEngineConfig
from arealite.train_engine.attention import register_attention, resolve_attn_impl
from arealite.train_engine.parallel.experts import apply_expert_parallel
from arealite.train_engine.parallel.layout import ParallelLayout, engine_layout_problems, layout_error
from arealite.train_engine.parallel.meshes import ParallelMeshes
from arealite.train_engine.lr_schedule import build_lr_scheduler
from arealite.train_engine.parallel.tensor import apply_tensor_parallel
from arealite.train_engine.vision_inputs import hide_image_outputs, is_vision_config, vision_blocks, vision_tower

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: Makes the Hugging Face module to train from its directory and config; called as
#: ``build(path, hf_config, attn_implementation=name)`` (the registered attention's name).
ModelBuilder = Callable[..., torch.nn.Module]

logger = logging.getLogger("arealite.train_engine.fsdp")


def compute_dtype(name: str, device_type: str) -> torch.dtype:
    """The compute dtype ``actor.dtype`` means on ``device_type``: ``auto`` is bf16 on CUDA, fp32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def without_dropout(hf_config: PretrainedConfig) -> PretrainedConfig:
    """A copy of a HF model config with every dropout probability set to 0.

    Architectures name them differently (``attention_dropout``, ``hidden_dropout``,
    ``resid_pdrop``, ...) and read them at construction, some as ``nn.Dropout``
    modules and some as floats passed to the attention function; zeroing them in
    the config covers both.
    """
    config = copy.deepcopy(hf_config)
    for key, value in config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    return config


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a HF causal LM (``model.model.layers`` for Llama/Qwen-style models)."""
    if callable(getattr(model, "get_base_model", None)):  # a PEFT model: the HF model it wraps
        model = model.get_base_model()
    inner = getattr(model, "model", None)
    inner = getattr(inner, "language_model", inner)  # a vision-language model's text decoder
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no .model.layers; FSDPEngine supports decoder-only HF models "
            f"(Llama/Qwen/Mistral style)"
        )
    return list(layers)


def _enable_checkpointing(model: torch.nn.Module) -> None:
    # Non-reentrant checkpointing composes with FSDP2's hooks.
    kw = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)


def causal_lm(path: Path, hf_config: PretrainedConfig, attn_implementation: str | None = None) -> torch.nn.Module:
    """The Hugging Face causal LM at ``path`` (fp32, dropout off, packed-sequence attention:
    ``attn_implementation`` as ``register_attention`` names it; None = the SDPA loop); a
    vision-language model's config gets that model (`vision_inputs.vision_language_model`)."""
    from transformers import AutoModelForCausalLM

    if is_vision_config(hf_config):
        return vision_language_model(path, hf_config, attn_implementation)

    return AutoModelForCausalLM.from_pretrained(
        path, config=without_dropout(hf_config), dtype=torch.float32,
        attn_implementation=attn_implementation or register_attention("sdpa_loop"),
    )


def vision_language_model(path: Path, hf_config: PretrainedConfig, attn_implementation: str | None = None) -> torch.nn.Module:
    """The vision-language model at ``path`` (fp32, dropout off): the language model with the
    packed attention ``attn_implementation`` names, the vision tower with SDPA (non-causal
    within each image; it never sees the text's packed-sequence boundaries)."""
    from transformers import AutoModelForImageTextToText

    from arealite.vision.placeholders import count_block_placeholders

    model = AutoModelForImageTextToText.from_pretrained(
        path, config=without_dropout(hf_config), dtype=torch.float32,
        attn_implementation={"text_config": attn_implementation or register_attention("sdpa_loop"),
                             "vision_config": "sdpa"},
    )
    count_block_placeholders(model)  # a pad the policy generated is text, as on the servers
    return model


def load_sharded_model(
    config: TrainEngineConfig, layout: ParallelLayout, meshes: ParallelMeshes, dtype: torch.dtype,
    device_type: str, frozen: bool,
    build: ModelBuilder = causal_lm, section: str = "actor", lora: bool = False,
) -> tuple[torch.nn.Module, PretrainedConfig, int]:
    """Load ``config.model_path`` with ``build``, split its layers over ``meshes.tp`` (tensor
    parallelism) and its experts over ``meshes.ep``, and shard the rest over ``meshes.fsdp``
    (`layout`'s meshes); returns ``(model, hf_config, n_layers)``.

    ``hf_config`` stays as the user wrote it (``export_hf`` saves it); ``build`` makes the
    module from the path and that config (a causal LM unless another model is wanted, such
    as the critic's value model), with the attention ``config.attn_impl`` resolves to on
    ``device_type`` (an impossible choice raises, naming ``{section}.attn_impl``), inside
    Ulysses' all-to-alls when ``config.sp_size > 1``. A layout the model cannot take raises,
    naming the fields (``lora``: the model will carry LoRA adapters, which some splits cannot
    take). A frozen model is in eval mode without gradients, else in train mode.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig

    path = Path(config.model_path)
    hf_config = AutoConfig.from_pretrained(path)
    problems = engine_layout_problems(section, config, layout.world, lora=lora, hf_config=hf_config.to_dict())
    if problems:
        raise layout_error(problems)
    attn = resolve_attn_impl(config.attn_impl, device_type, dtype, field=f"{section}.attn_impl")
    logger.info("%s.attn_impl=%s: packed attention runs as %s", section, config.attn_impl, attn)
    model = build(path, hf_config, attn_implementation=register_attention(attn, meshes.sp))
    model.config.use_cache = False
    if config.gradient_checkpointing and not frozen:
        _enable_checkpointing(model)
    if meshes.tp is not None:
        apply_tensor_parallel(decoder_layers(model), meshes.tp)
    experts = None
    if meshes.ep is not None:  # each rank keeps its experts; FSDP2 shards the rest
        device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
        experts = apply_expert_parallel(model, meshes.ep, device)

    # With one rank a shard is the whole tensor: re-gathering it for backward is pure copying.
    sharded = layout.dp_shard * layout.sp > 1
    kwargs: dict[str, object] = {"mesh": meshes.fsdp, "reshard_after_forward": sharded, "ignored_params": experts}
    if dtype != torch.float32:
        # Low-precision compute, fp32 gradient reduction: the sum over ranks keeps its precision.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if config.cpu_offload:
        if device_type == "cpu":
            logger.info("%s.cpu_offload has no effect on CPU: parameters already live there", section)
        else:
            kwargs["offload_policy"] = CPUOffloadPolicy()
    layers = decoder_layers(model)
    for layer in vision_blocks(model) + layers:
        fully_shard(layer, **kwargs)
    if is_vision_config(hf_config):
        hide_image_outputs(model)  # before fully_shard: its output hooks must not see the image features
    fully_shard(model, **kwargs)
    if frozen:
        model.eval()
        model.requires_grad_(False)
    else:
        model.train()
    _freeze_vision(model, config, section)
    return model, hf_config, len(layers)


def _freeze_vision(model: torch.nn.Module, config: TrainEngineConfig, section: str) -> None:
    """``{section}.freeze_vision``: the vision tower without gradients (so without optimizer state)."""
    if not config.freeze_vision:
        return
    tower = vision_tower(model)
    if tower is None:
        raise ValueError(f"{section}.freeze_vision=true but {config.model_path} has no vision tower; set it to false")
    tower.requires_grad_(False)


def build_optimizer(
    model: torch.nn.Module, opt: OptimizerConfig, total_steps: int | None
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW on ``model``'s trainable parameters (all of them, or a LoRA model's adapters) and its
    LR schedule (``total_steps`` overrides ``opt.total_steps``)."""
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=opt.lr,
        betas=(opt.beta1, opt.beta2),
        eps=opt.eps,
        weight_decay=opt.weight_decay,
        # torch picks the slow per-tensor loop for DTensor params unless told.
        foreach=True,
    )
    scheduler = build_lr_scheduler(
        optimizer,
        opt.lr_scheduler,
        opt.warmup_steps,
        total_steps if total_steps is not None else opt.total_steps,
        opt.min_lr_ratio,
    )
    return optimizer, scheduler
