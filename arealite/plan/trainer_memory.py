"""The peak memory of a trainer rank in one train step, predicted from the config and config.json.

What a rank holds (the largest rank of the layout ``ParallelLayout.of(section, n_trainer_procs)``;
FSDP2 pads every shard to the same size, so the ranks hold the same):

- the float32 master parameters: FSDP2's dim-0 shard over ``dp_shard x sp`` ranks of each
  parameter's tensor-parallel slice, the experts' ``1 / ep`` whole under ep (FSDP2 leaves them);
- their float32 gradients (trainable parameters only: LoRA's adapters) and AdamW's two float32
  moments per trainable parameter;
- FSDP2's unsharded buffers at the compute dtype: the root (embeddings, final norm, head) stays
  gathered from its forward to its backward (the engine's ``set_reshard_after_forward(False,
  recurse=False)``), the layer being computed and the next one prefetched; with one shard
  (``dp_shard x sp = 1``) every layer stays gathered (``reshard_after_forward=False``);
- with several micro-batches in a step, the unsharded gradients FSDP2 accumulates without
  reducing (float32) until the last one;
- the activations of the largest micro-batch (`activations.trace_layer` x the layers, the
  embedding's output and the rotary tables), the head's chunk and the loss (`trace_tail`).

The peak is the largest of the step's phases: the head's forward (every layer's activations
alive), the backward's start (the head's and then the last layer's backward), the end of the
backward (the root's gradients reduced) and the optimizer step (AdamW's foreach temporaries).
"""

from __future__ import annotations

import math

import torch

from arealite.config.schema import ArealiteConfig, TrainEngineConfig
from arealite.plan.activations import trace_layer, trace_tail
from arealite.plan.breakdown import MemoryBreakdown
from arealite.plan.model_shapes import ModelShapes, ParamShape, load_hf_config, model_shapes
from arealite.train_engine.fsdp_model import compute_dtype
from arealite.train_engine.parallel.layout import ParallelLayout

__all__ = ["trainer_rank_memory", "largest_microbatch"]

NOT_MODELLED = ("not modelled: the allocator's fragmentation and cached blocks (PyTorch's caching allocator "
                "typically adds 5-15% on a GPU), NCCL's buffers and the CUDA context (~0.5-1 GiB per GPU)")
#: A mixture of experts' routing depends on the data, which fake tensors do not have.
BALANCED_ROUTING = "MoE experts are traced with balanced routing; an unbalanced router loads some ranks more"


def _local_numel(p: ParamShape, layout: ParallelLayout, shard: bool = True) -> int:
    """Elements of ``p`` one rank holds: its tensor-parallel slice (or its experts under ep), then
    FSDP2's padded dim-0 shard of it (``shard``; never the experts under ep)."""
    shape = list(p.shape)
    if p.split == "experts" and layout.ep > 1:
        return math.prod(shape) // layout.ep
    if layout.tp > 1 and p.split == "column":
        shape[0] //= layout.tp
    elif layout.tp > 1 and p.split == "row" and len(shape) > 1:
        shape[1] //= layout.tp
    if shard and shape:
        shape[0] = -(-shape[0] // (layout.dp_shard * layout.sp))
    return math.prod(shape)


def _fsdp_unit_numel(params: list[ParamShape], layout: ParallelLayout) -> int:
    """Unsharded elements of one FSDP2 unit on a rank (its tensor-parallel slices; no experts under ep)."""
    return sum(_local_numel(p, layout, shard=False) for p in params
               if not (p.split == "experts" and layout.ep > 1))


def largest_microbatch(cfg: ArealiteConfig, engine: TrainEngineConfig) -> list[int]:
    """The sequence lengths of the largest micro-batch the config allows: answers of the longest
    prompt plus ``generation.max_new_tokens`` packed up to ``mb_max_tokens``; an answer longer than
    the budget is a micro-batch of its own (packing never splits a row)."""
    longest = (cfg.data.max_prompt_len or 0) + cfg.generation.max_new_tokens
    if longest >= engine.mb_max_tokens:
        return [longest]
    n, rest = divmod(engine.mb_max_tokens, longest)
    return [longest] * n + ([rest] if rest else [])


def _n_microbatches(cfg: ArealiteConfig, engine: TrainEngineConfig, layout: ParallelLayout) -> int:
    """Micro-batches of a step on one rank at the longest answers (the optimizer step's share)."""
    rows = cfg.rollout.consumer_batch_size * cfg.generation.n_samples / max(cfg.algorithm.n_minibatches, 1)
    longest = (cfg.data.max_prompt_len or 0) + cfg.generation.max_new_tokens
    per_micro_batch = max(1, engine.mb_max_tokens // longest)
    return max(1, math.ceil(rows / layout.dp / per_micro_batch))


def trainer_rank_memory(cfg: ArealiteConfig, section: str = "actor", hf_config: dict | None = None,
                        device: str = "cuda", *, seq_lens: list[int] | None = None,
                        n_microbatches: int | None = None, entropy: bool = False,
                        shapes: ModelShapes | None = None) -> MemoryBreakdown:
    """The largest trainer rank's peak of one train step of ``section`` (``actor`` or ``critic``)
    on ``device`` (``cuda``: ``dtype: auto`` computes in bf16; ``cpu``: fp32).

    ``hf_config``: the model's config.json as a dict (default: read from the section's
    ``model_path``); ``seq_lens``: the largest micro-batch's sequence lengths (default
    `largest_microbatch`); ``n_microbatches``: per rank and step (default from the batch size);
    ``entropy``: the loss also takes the entropy (a second chunk buffer)."""
    if section not in ("actor", "critic"):
        raise ValueError(f"section={section!r}: the trainer trains 'actor' or 'critic'")
    engine = cfg.actor if section == "actor" else cfg.critic
    lora = cfg.actor.lora if section == "actor" else None
    value = section == "critic"
    if hf_config is None:
        path = (cfg.critic.model_path if value else None) or cfg.actor.model_path
        if not path:
            raise ValueError(f"{section}.model_path is empty: the planner reads the model's config.json from it")
        hf = load_hf_config(path)
    else:
        hf = load_hf_config(hf_config)
    layout = ParallelLayout.of(engine, cfg.launch.n_trainer_procs)
    dtype = compute_dtype(engine.dtype, device)
    shapes = shapes or model_shapes(hf, value_model=value, lora=lora)
    seq_lens = seq_lens or largest_microbatch(cfg, engine)
    n_mb = n_microbatches or _n_microbatches(cfg, engine, layout)

    parts = _state_parts(shapes, layout, dtype, engine)
    acts = _activation_parts(hf, shapes, layout, dtype, engine, seq_lens, lora, value, entropy)
    if n_mb > 1 and not engine.cpu_offload:  # FSDP2 accumulates unsharded float32 gradients
        parts["accumulated gradients"] = parts.pop("_accumulated")
    else:
        parts.pop("_accumulated")
    phases = _phases(parts, acts)
    name, peak = max(phases.items(), key=lambda kv: sum(kv[1].values()))
    out = MemoryBreakdown(f"trainer rank ({section}), {layout.describe()}, {dtype}".replace("torch.", ""))
    for part, nbytes in peak.items():
        out.add(part, nbytes)
    out.notes.append(f"peak phase: {name}; the others: "
                     + ", ".join(f"{n} {sum(p.values()) / 2**20:.1f} MiB" for n, p in phases.items() if n != name))
    out.notes.append(f"largest micro-batch: {sum(seq_lens)} tokens in {len(seq_lens)} sequences (longest "
                     f"{max(seq_lens)}), {math.ceil(sum(seq_lens) / layout.sp)} per rank; {n_mb} micro-batch(es) per step")
    out.notes.append(NOT_MODELLED)
    if getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None):
        out.notes.append(BALANCED_ROUTING)
    return out


def _state_parts(shapes: ModelShapes, layout: ParallelLayout, dtype: torch.dtype,
                 engine: TrainEngineConfig) -> dict[str, int]:
    """Parameters, gradients, optimizer state and FSDP2's unsharded buffers, in bytes."""
    cb = torch.finfo(dtype).bits // 8
    local = {p.name: _local_numel(p, layout) for p in shapes.params}
    trainable = sum(local[p.name] for p in shapes.params if p.trainable)
    experts = sum(local[p.name] for p in shapes.params if p.split == "experts" and layout.ep > 1)
    layers = [_fsdp_unit_numel(shapes.layer(i), layout) for i in range(shapes.n_layers)]
    layers += [_fsdp_unit_numel(ps, layout) for ps in shapes.vision_blocks().values()]
    root = _fsdp_unit_numel(shapes.root(), layout)
    sharded = layout.dp_shard * layout.sp > 1
    gathered = sum(sorted(layers)[-2:]) if sharded else sum(layers)
    root_trainable = sum(_local_numel(p, layout, shard=False) for p in shapes.root() if p.trainable)
    unsharded_trainable = sum(_local_numel(p, layout, shard=False) for p in shapes.params
                              if p.trainable and not (p.split == "experts" and layout.ep > 1))
    return {
        "parameters (fp32 shard)": 4 * (sum(local.values()) - experts),
        "experts (ep, fp32)": 4 * experts,
        "optimizer (AdamW, fp32)": 8 * trainable,
        "_gradients": 4 * trainable,
        "_root gathered": cb * root,
        "_layers gathered": cb * gathered,
        "_root gradients": cb * root_trainable,
        "_reduce-scatter": 4 * root_trainable,
        "_accumulated": 4 * unsharded_trainable,
        "_optimizer step temporaries": 4 * trainable,
    }


def _activation_parts(hf, shapes: ModelShapes, layout: ParallelLayout, dtype: torch.dtype,
                      engine: TrainEngineConfig, seq_lens: list[int], lora, value: bool,
                      entropy: bool) -> dict[str, int]:
    """The traced activation bytes of the largest micro-batch on one rank."""
    layer = trace_layer(hf, seq_lens, dtype, checkpointing=engine.gradient_checkpointing, sp=layout.sp,
                        tp=layout.tp, ep=layout.ep, lora=lora, value_model=value)
    tail = trace_tail(hf, layer.tokens, dtype, entropy=entropy, value_model=value)
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    cb = torch.finfo(dtype).bits // 8
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    hidden = layer.tokens * text.hidden_size * cb
    return {
        "activations": shapes.n_layers * layer.kept + hidden + 2 * layer.tokens * head_dim * cb,
        "layer backward": layer.backward_peak,
        "hidden gradient": hidden,
        "head forward": tail.forward_peak,
        "head kept": tail.kept,
        "head backward": tail.backward_peak,
    }


def _phases(parts: dict[str, int], acts: dict[str, int]) -> dict[str, dict[str, int]]:
    """The bytes alive at each candidate peak of the step, part by part."""
    base = {k: v for k, v in parts.items() if not k.startswith("_") and v}
    gathered = {"FSDP2 root gathered": parts["_root gathered"], "FSDP2 layers gathered": parts["_layers gathered"]}
    forward = {**base, **gathered, "activations": acts["activations"], "head chunk (forward)": acts["head forward"]}
    head_bwd = {**base, **gathered, "activations": acts["activations"], "head saved": acts["head kept"],
                "head chunk (backward)": acts["head backward"]}
    layer_bwd = {**base, **gathered, "activations": acts["activations"], "hidden gradient": acts["hidden gradient"],
                 "root gradients (unsharded)": parts["_root gradients"], "layer backward": acts["layer backward"]}
    grads = {"gradients (fp32 shard)": parts["_gradients"]}
    end = {**base, **grads, **gathered, "root gradients (unsharded)": parts["_root gradients"],
           "reduce-scatter buffer (fp32)": parts["_reduce-scatter"]}
    step = {**base, **grads, "optimizer step temporaries": parts["_optimizer step temporaries"]}
    return {"head forward": forward, "head backward": head_bwd, "last layer backward": layer_bwd,
            "backward end": end, "optimizer step": step}
