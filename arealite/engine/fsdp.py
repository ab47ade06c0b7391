"""The train engine: a Hugging Face causal LM sharded with FSDP2.

``FSDPEngine`` trains any loss it is given on packed micro-batches, computes
log-probs (or any per-token value) without a graph, checkpoints, exports a
Hugging Face directory and yields full weights for syncing inference servers.
It knows nothing of PPO or GRPO: the algorithm lives in ``arealite.algo``.

Launch under ``torchrun`` (one process per GPU; gloo processes on CPU), or in a
plain process: ``initialize()`` then creates a world of one.

Dropout is off, in training as in ``forward``: the PPO loss takes the proximal
log-probs from the training forward itself (``arealite.algo.actor``), so that
forward must score tokens exactly as ``forward`` and the inference servers do.

Layout of the data it is given and of the micro-batches it hands to loss
functions (``mb``): see docs/internals.md and ``arealite.engine.packing``.

Attention over packed sequences: the model runs with the attention function
``packing.varlen_sdpa_attention`` (registered with transformers), which gets the
sequence boundaries (``cu_seq_lens_q``) and runs causal SDPA per sequence, so no
token attends across a boundary and no compute goes to cross-sequence blocks.
(Position ids alone do not isolate packed sequences on the SDPA path of
transformers 5, and a block-diagonal mask costs T x T per micro-batch.)
"""

from __future__ import annotations

import copy
import logging
import math
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from arealite.config.schema import ActorConfig
from arealite.engine.lr_schedule import build_lr_scheduler
from arealite.engine.packing import (
    PackedIndex,
    pack,
    register_varlen_attention,
    sequence_lengths,
    split_into_microbatches,
    unpack,
)
from arealite.utils.buckets import buckets_of
from arealite.utils.dist import default_backend, init_default_group, resolve_device_type

logger = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, dict], torch.Tensor]
WeightFn = Callable[[dict], Any]
PostHook = Callable[[torch.Tensor, dict], torch.Tensor]

# Files of a model directory that are weights; everything else (config,
# tokenizer, chat template, generation config) is copied by export_hf.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


class FSDPEngine:
    """Train engine on FSDP2 (``torch.distributed.fsdp.fully_shard``).

    ``frozen=True`` builds a reference model: no optimizer, eval mode, no
    gradients; only ``forward`` (and weight export) is available.
    ``device``: ``auto`` (CUDA and NCCL when available), ``cpu`` (gloo, even on
    a GPU machine) or ``cuda``.
    """

    def __init__(self, config: ActorConfig, frozen: bool = False, device: str = "auto"):
        if not config.model_path:
            raise ValueError("actor.model_path is empty; set it to a Hugging Face model directory")
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"FSDPEngine device={device!r} is not one of auto, cpu, cuda")
        self.config = config
        self.frozen = frozen
        self._device_choice = device
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler = None
        self.hf_config = None
        self.rank = 0
        self.world_size = 1
        self.device = torch.device("cpu")
        self.dtype = torch.float32  # compute dtype, resolved from actor.dtype by initialize()
        self._owns_group = False
        self._version = 0
        self._step = 0  # optimizer steps taken (skipped steps excluded)
        self._pad_id = 0

    # ------------------------------------------------------------------ setup

    def initialize(self, total_steps: int | None = None) -> "FSDPEngine":
        """Join/create the process group, load and shard the model, build AdamW and the LR schedule.

        ``total_steps`` overrides ``optimizer.total_steps`` (training scripts
        know it from the data).
        """
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.model is not None:
            raise RuntimeError("FSDPEngine.initialize() was already called")
        path = Path(self.config.model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"actor.model_path={str(path)!r} has no config.json; it must be a Hugging Face model directory"
            )
        device_type = resolve_device_type(self._device_choice)
        backend = default_backend(device_type)
        self._owns_group = init_default_group(backend)
        if dist.get_backend() != backend:
            raise ValueError(
                f"FSDPEngine(device={self._device_choice!r}) computes on {device_type}, which needs a {backend} "
                f"process group, but the existing default group is {dist.get_backend()}"
            )
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if device_type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.mesh = init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("dp",))
        self.dtype = compute_dtype(self.config.dtype, device_type)

        self.hf_config = AutoConfig.from_pretrained(path)
        self._pad_id = int(self.hf_config.pad_token_id or 0)
        # Master weights are fp32 always; `dtype` only sets the compute dtype.
        # `hf_config` stays as the user wrote it (export_hf saves it); the model gets a dropout-free copy.
        model = AutoModelForCausalLM.from_pretrained(
            path, config=_without_dropout(self.hf_config), dtype=torch.float32,
            attn_implementation=register_varlen_attention(),
        )
        model.config.use_cache = False
        if self.config.gradient_checkpointing and not self.frozen:
            # Non-reentrant checkpointing composes with FSDP2's hooks.
            kw = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)

        # With one rank a shard is the whole tensor: re-gathering it for backward is pure copying.
        kwargs: dict[str, Any] = {"mesh": self.mesh, "reshard_after_forward": self.world_size > 1}
        if self.dtype != torch.float32:
            # Low-precision compute, fp32 gradient reduction: the sum over ranks keeps its precision.
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        if self.config.cpu_offload:
            if device_type == "cpu":
                logger.info("actor.cpu_offload has no effect on CPU: parameters already live there")
            else:
                kwargs["offload_policy"] = CPUOffloadPolicy()
        layers = _decoder_layers(model)
        for layer in layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        self.model = model

        if self.frozen:
            model.eval()
            model.requires_grad_(False)
        else:
            model.train()
            opt = self.config.optimizer
            self.optimizer = torch.optim.AdamW(
                model.parameters(),
                lr=opt.lr,
                betas=(opt.beta1, opt.beta2),
                eps=opt.eps,
                weight_decay=opt.weight_decay,
                # torch picks the slow per-tensor loop for DTensor params unless told.
                foreach=True,
            )
            self.lr_scheduler = build_lr_scheduler(
                self.optimizer,
                opt.lr_scheduler,
                opt.warmup_steps,
                total_steps if total_steps is not None else opt.total_steps,
                opt.min_lr_ratio,
            )
        logger.info(
            "FSDPEngine ready: rank %d/%d on %s, %d decoder layers sharded, dtype=%s, frozen=%s",
            self.rank, self.world_size, device_type, len(layers), self.dtype, self.frozen,
        )
        return self

    def destroy(self) -> None:
        """Free the model and optimizer; destroy the process group if this engine created it."""
        self.model = self.optimizer = self.lr_scheduler = None
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False

    def get_version(self) -> int:
        """Policy version of the current weights."""
        return self._version

    def set_version(self, version: int) -> None:
        """Set the policy version (the training script bumps it after each weight update)."""
        self._version = int(version)

    @property
    def step_count(self) -> int:
        """Optimizer steps taken so far (skipped steps excluded)."""
        return self._step

    # ------------------------------------------------------------ micro-batching

    def _require(self, train: bool = False) -> None:
        if self.model is None:
            raise RuntimeError("FSDPEngine is not initialized (call initialize()) or was destroyed")
        if train and self.frozen:
            raise RuntimeError("this FSDPEngine is frozen (a reference model): it cannot train")

    @staticmethod
    def _as_dict(batch: Any) -> dict[str, torch.Tensor]:
        """The batch's tensors as a flat dict; non-tensor entries are not per-token data and are left out."""
        keys = list(batch.keys())
        data = {k: batch[k] for k in keys if isinstance(batch[k], torch.Tensor)}
        for need in ("input_ids", "attention_mask"):
            if need not in data:
                raise KeyError(f"batch has no '{need}' (keys: {sorted(keys)}); both are required")
        if data["input_ids"].dim() != 2:
            raise ValueError(f"batch 'input_ids' must be [B, L], got shape {tuple(data['input_ids'].shape)}")
        if data["attention_mask"].shape != data["input_ids"].shape:
            raise ValueError(
                f"batch 'attention_mask' has shape {tuple(data['attention_mask'].shape)}, "
                f"'input_ids' has {tuple(data['input_ids'].shape)}; they must match"
            )
        return data

    def _plan(self, data: dict[str, torch.Tensor]) -> list[tuple[dict | None, PackedIndex | None]]:
        """Pack the local rows into micro-batches; every rank gets the same count.

        A ``None`` micro-batch is a dummy: a rank with fewer real micro-batches
        still runs forward (and backward) so that FSDP's collectives line up.
        """
        lengths = sequence_lengths(data["attention_mask"]).tolist()
        for r, n in enumerate(lengths):
            if n == 0:
                raise ValueError(f"batch row {r} has no real tokens (attention_mask all 0); drop it before training")
        groups = split_into_microbatches(lengths, self.config.mb_max_tokens)
        count = torch.tensor([len(groups)], dtype=torch.int64, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        n_mb = int(count.item())
        if n_mb == 0:
            raise ValueError("the batch is empty on every rank: nothing to compute")
        if n_mb > len(groups):
            groups = split_into_microbatches(lengths, self.config.mb_max_tokens, min_count=n_mb)
        plan: list[tuple[dict | None, PackedIndex | None]] = []
        for rows in groups:
            if rows:
                mb, index = pack(data, rows, lengths)
                plan.append(({k: v.to(self.device) for k, v in mb.items()}, index))
            else:
                plan.append((None, None))
        return plan

    def _logits(self, mb: dict | None) -> torch.Tensor:
        """Logits ``[T, V]`` (fp32) of a packed micro-batch; a dummy runs one pad token."""
        if mb is None:
            ids = torch.tensor([[self._pad_id]], device=self.device)
            return self.model(input_ids=ids, use_cache=False).logits[0].float()
        # The attention function reads the boundaries from cu_seq_lens_q
        # (the keyword transformers' varlen attention paths use).
        out = self.model(
            input_ids=mb["input_ids"][None],
            position_ids=mb["position_ids"][None],
            cu_seq_lens_q=mb["cu_seqlens"],
            use_cache=False,
        )
        return out.logits[0].float()

    # ------------------------------------------------------------------ train

    def train_batch(self, batch: Any, loss_fn: LossFn, loss_weight_fn: WeightFn) -> dict[str, float]:
        """One optimizer step on ``batch`` (a right-padded ``[B, L]`` TensorDict or dict).

        ``loss_fn(logits [T, V], mb)`` is the mean loss of one packed
        micro-batch; ``loss_weight_fn(mb)`` its weight (e.g. its loss tokens).
        Each micro-batch loss is scaled by ``weight / global_weight`` (global =
        all micro-batches of all ranks) times the world size, which cancels
        FSDP's averaging of gradients over ranks: the step minimises exactly
        the global weighted mean. A non-finite gradient norm skips the update.
        Returns ``grad_norm, lr, loss, n_tokens, n_tokens_computed, n_seqs,
        n_mbs, skipped`` and the weighted mean of each stat the loss put in
        ``mb["_stats"]``. ``n_tokens`` counts real tokens, ``n_tokens_computed``
        the tokens the forward passes ran (packing adds no padding; a dummy
        micro-batch runs one token); both are sums over ranks.
        """
        self._require(train=True)
        data = self._as_dict(batch)
        plan = self._plan(data)
        weights = []
        for mb, _ in plan:
            weights.append(0.0 if mb is None else _as_weight(loss_weight_fn(mb)))
        totals = torch.tensor(
            [
                sum(weights),
                sum(i.total_tokens for _, i in plan if i),
                sum(i.total_tokens if i else 1 for _, i in plan),
                sum(len(i.rows) for _, i in plan if i),
            ],
            dtype=torch.float64, device=self.device,
        )
        dist.all_reduce(totals)
        total_weight, n_tokens, n_computed, n_seqs = (float(x) for x in totals.tolist())
        lr = self.optimizer.param_groups[0]["lr"]
        base = {
            "lr": lr, "n_tokens": n_tokens, "n_tokens_computed": n_computed, "n_seqs": n_seqs,
            "n_mbs": float(len(plan)),
        }

        self.optimizer.zero_grad(set_to_none=True)
        if total_weight <= 0:
            # Every rank sees the same global total, so all skip together.
            logger.warning("train_batch: total loss weight is 0 (nothing to learn from); step skipped")
            return {**base, "grad_norm": 0.0, "loss": 0.0, "skipped": 1.0}

        scale = self.world_size / total_weight
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        stat_sums: dict[str, list[float]] = {}
        for i, ((mb, _), w) in enumerate(zip(plan, weights)):
            # Reduce-scatter gradients once, after the last micro-batch.
            if not self.config.cpu_offload:
                self.model.set_requires_gradient_sync(i == len(plan) - 1)
            logits = self._logits(mb)
            if mb is None:
                loss = logits.sum() * 0.0
                loss.backward()
                continue
            loss = loss_fn(logits, mb)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise TypeError(
                    f"loss_fn must return a 0-dim tensor (the micro-batch mean loss), got "
                    f"{type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}"
                )
            (loss * (w * scale)).backward()
            loss_sum += loss.detach().double() * w
            for k, v in (mb.get("_stats") or {}).items():
                v = float(v.detach() if isinstance(v, torch.Tensor) else v)
                if k.endswith("_max"):  # a maximum stays a maximum
                    acc = stat_sums.setdefault(k, [-math.inf, 1.0])
                    acc[0] = max(acc[0], v)
                    continue
                acc = stat_sums.setdefault(k, [0.0, 0.0])
                acc[0] += v * w
                acc[1] += w
        self.model.set_requires_gradient_sync(True)

        grad_norm = self._clip_grad_norm()
        skipped = not math.isfinite(grad_norm)
        if skipped:
            logger.warning("train_batch: non-finite gradient norm (%s); optimizer step skipped", grad_norm)
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.lr_scheduler.step()
            self._step += 1

        dist.all_reduce(loss_sum)
        stats = {**base, "grad_norm": grad_norm, "loss": float(loss_sum) / total_weight, "skipped": float(skipped)}
        stats.update(self._reduce_stats(stat_sums))
        return stats

    def _clip_grad_norm(self) -> float:
        """Global gradient norm (clipped to ``gradient_clipping`` if > 0)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.config.optimizer.gradient_clipping
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=clip if clip > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()  # DTensor grads: the norm is a partial sum over ranks
        return float(norm)

    def _reduce_stats(self, stat_sums: dict[str, list[float]]) -> dict[str, float]:
        """Weighted mean of loss-function stats over micro-batches and ranks (``*_max``: the maximum)."""
        if self.world_size > 1:
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, stat_sums)
        else:
            gathered = [stat_sums]
        merged: dict[str, list[float]] = {}
        for part in gathered:
            for k, (s, w) in part.items():
                if k.endswith("_max"):
                    acc = merged.setdefault(k, [-math.inf, 1.0])
                    acc[0] = max(acc[0], s)
                    continue
                acc = merged.setdefault(k, [0.0, 0.0])
                acc[0] += s
                acc[1] += w
        return {k: (s / w if w > 0 else 0.0) for k, (s, w) in merged.items()}

    # ---------------------------------------------------------------- forward

    @torch.no_grad()
    def forward(self, batch: Any, post_hook: PostHook, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Per-token values ``[B, L]`` without a graph (e.g. log-probs of the taken tokens).

        ``post_hook(logits [T, V], mb) -> [T]`` scores ``labels``; the value of
        ``labels[t]`` lands at the position of that token, so ``out[b, j]``
        belongs to ``input_ids[b, j]`` and position 0 of each row is 0.
        Runs in eval mode (the model's mode is restored after).
        """
        self._require()
        data = self._as_dict(batch)
        out = torch.zeros(data["input_ids"].shape, dtype=out_dtype)
        was_training = self.model.training
        self.model.eval()
        try:
            for mb, index in self._plan(data):
                logits = self._logits(mb)
                if mb is None:
                    continue
                values = post_hook(logits, mb)
                unpack(values.detach().to("cpu"), index, out)
        finally:
            self.model.train(was_training)
        return out.to(data["input_ids"].device)

    # ------------------------------------------------------------ checkpoints

    def save(self, path: str | os.PathLike) -> None:
        """Sharded checkpoint (DCP): model, optimizer, LR schedule, RNG per rank, version, step."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        self._require()
        path = Path(path)
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        if self.frozen:
            state = {"model": get_model_state_dict(self.model)}
        else:
            msd, osd = get_state_dict(self.model, self.optimizer)
            state = {"model": msd, "optim": osd}
        dcp.save(state, checkpoint_id=str(path))
        extra = {
            "version": self._version,
            "step": self._step,
            "world_size": self.world_size,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
            "rng_torch": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state() if self.device.type == "cuda" else None,
            "rng_python": random.getstate(),
        }
        torch.save(extra, path / f"engine_rank{self.rank}.pt")
        dist.barrier()

    def load(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint written by ``save`` (DCP reshards if the world size changed)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_state_dict,
            set_model_state_dict,
            set_state_dict,
        )

        self._require()
        path = Path(path)
        if not (path / ".metadata").is_file():
            raise FileNotFoundError(f"{str(path)!r} is not an FSDPEngine checkpoint (no DCP .metadata file)")
        if self.frozen:
            state = {"model": get_model_state_dict(self.model)}
            dcp.load(state, checkpoint_id=str(path))
            set_model_state_dict(self.model, state["model"])
        else:
            msd, osd = get_state_dict(self.model, self.optimizer)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=str(path))
            set_state_dict(
                self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
        extra_file = path / f"engine_rank{self.rank}.pt"
        if not extra_file.is_file():
            extra_file = path / "engine_rank0.pt"
        extra = torch.load(extra_file, weights_only=False)  # our own file: python RNG state is a tuple
        self._version = int(extra["version"])
        self._step = int(extra["step"])
        if self.lr_scheduler is not None and extra["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        if extra["world_size"] == self.world_size:
            torch.set_rng_state(extra["rng_torch"])
            random.setstate(extra["rng_python"])
            if extra["rng_cuda"] is not None and self.device.type == "cuda":
                torch.cuda.set_rng_state(extra["rng_cuda"])
        else:
            logger.warning(
                "checkpoint was written by %d ranks, now %d: per-rank RNG state not restored",
                extra["world_size"], self.world_size,
            )
        dist.barrier()

    def export_hf(self, path: str | os.PathLike) -> None:
        """Write a full Hugging Face directory (safetensors, config, tokenizer) from rank 0.

        Every rank must call it (gathering the full state dict is a collective).
        """
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        self._require()
        full = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.rank == 0:
            path = Path(path)
            path.mkdir(parents=True, exist_ok=True)
            src = Path(self.config.model_path)
            for f in src.iterdir():
                if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name != "config.json":
                    shutil.copy2(f, path / f.name)
            self.hf_config.save_pretrained(path)
            tensors = {k: v.contiguous() for k, v in full.items() if k not in self._tied_duplicate_names()}
            save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        dist.barrier()

    def _tied_duplicate_names(self) -> set[str]:
        """State-dict names that alias another parameter and are absent from HF safetensors files."""
        if getattr(self.hf_config, "tie_word_embeddings", False):
            return {"lm_head.weight"}
        return set()

    def named_weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full (unsharded) weights in HF names, in buckets of at most ``bucket_bytes``.

        A tensor larger than ``bucket_bytes`` makes a bucket of its own. Tied
        weights appear once, under the name the HF safetensors file uses
        (``model.embed_tokens.weight``). Unsharding is a collective: EVERY rank
        must iterate the generator to the end in the same order, even if only
        rank 0 uses the tensors. At most one bucket is materialised at a time.
        """
        self._require()
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0 (weight_sync.bucket_size_mb)")
        skip = self._tied_duplicate_names()

        def full_weights() -> Iterator[tuple[str, torch.Tensor]]:
            # named_parameters() yields a tied parameter once, under its first name.
            for name, p in self.model.named_parameters():
                if name in skip:
                    continue
                t = p.detach()
                if t.device != self.device:
                    t = t.to(self.device)  # CPU-offloaded shards: NCCL gathers on the GPU
                yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t)

        yield from buckets_of(full_weights(), bucket_bytes)


def compute_dtype(name: str, device_type: str) -> torch.dtype:
    """The compute dtype ``actor.dtype`` means on ``device_type``: ``auto`` is bf16 on CUDA, fp32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _without_dropout(hf_config: Any) -> Any:
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


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a HF causal LM (``model.model.layers`` for Llama/Qwen-style models)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no .model.layers; FSDPEngine supports decoder-only HF models "
            f"(Llama/Qwen/Mistral style)"
        )
    return list(layers)


def _as_weight(w: Any) -> float:
    """A micro-batch loss weight as a float; must be finite and >= 0."""
    value = float(w.detach().item()) if isinstance(w, torch.Tensor) else float(w)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"loss_weight_fn returned {value}; weights must be finite and >= 0")
    return value
