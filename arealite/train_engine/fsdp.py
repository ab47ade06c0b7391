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
functions (``mb``): see docs/internals.md and ``arealite.train_engine.packing``.

Attention over packed sequences: the model runs with the attention function
``actor.attn_impl`` picks from ``arealite.train_engine.attention`` (registered with
transformers), which gets the sequence boundaries (``cu_seq_lens_q``) and runs causal
attention within each sequence, so no token attends across a boundary.
(Position ids alone do not isolate packed sequences on the SDPA path of
transformers 5, and a block-diagonal mask costs T x T per micro-batch.)

Logits are never materialised on the way to a loss: the model runs to its last
hidden states (its output head skipped, ``lm_head.capture_head``) and the loss
gets a ``HeadOutput`` whose ``logprobs``/``logprobs_entropy`` apply the head in
chunks of rows (``arealite.ops.fused_logprob``); ``logits()`` materialises them on request.
The root FSDP module (embeddings, final norm, output head) therefore keeps its
parameters gathered from its forward to its backward, as FSDP2 does for a root
by default.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from arealite.api.contracts import HeadOutput, LossFn, LossWeightFn, MicroBatchStats, PostHook, TrainBatch
from arealite.config.schema import LoraConfig, TrainEngineConfig
from arealite.moe.router_hooks import RouterLoadBalance, moe_routers
from arealite.moe.trajectory import replay_routing  # MoE routing replay (R3)
from arealite.train_engine.fsdp_checkpoint import (
    export_hf_dir,
    load_sharded,
    restore_rng,
    rng_state,
    save_sharded,
    tied_duplicate_names,
)
from arealite.train_engine.fsdp_model import build_optimizer, causal_lm, compute_dtype, load_sharded_model
from arealite.train_engine.lm_head import ChunkedHead, capture_head, output_head
from arealite.train_engine.microbatch import MicroBatchPlanner, PackedMicroBatch
from arealite.train_engine.packing import PackedIndex, unpack
from arealite.train_engine.parallel.experts import finish_expert_gradients
from arealite.train_engine.parallel.grad_norm import clip_grad_norm
from arealite.train_engine.parallel.layout import ParallelLayout, engine_layout_problems, layout_error
from arealite.train_engine.parallel.meshes import ParallelMeshes, build_meshes
from arealite.train_engine.parallel.moe_tokens import MoeTokenSplit, finish_moe_gradients, split_moe_tokens
from arealite.train_engine.parallel.sequence import SequenceParallel
from arealite.train_engine.parallel.tensor import whole_tensor
from arealite.train_engine.vision_inputs import image_pass, is_vision_config
from arealite.utils.buckets import buckets_of
from arealite.utils.checkpoint_names import checkpoint_tensors
from arealite.utils.dist import default_backend, init_default_group, resolve_device_type

__all__ = ["FSDPEngine", "compute_dtype"]

logger = logging.getLogger(__name__)


class FSDPEngine:
    """Train engine on FSDP2 (``torch.distributed.fsdp.fully_shard``).

    ``frozen=True`` builds a reference model: no optimizer, eval mode, no
    gradients; only ``forward`` (and weight export) is available.
    ``device``: ``auto`` (CUDA and NCCL when available), ``cpu`` (gloo, even on
    a GPU machine) or ``cuda``.
    """

    def __init__(self, config: TrainEngineConfig, frozen: bool = False, device: str = "auto"):
        if not config.model_path:
            raise ValueError(f"{self.section}.model_path is empty; set it to a Hugging Face model directory")
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
        self.planner: MicroBatchPlanner | None = None  # the batch -> micro-batches -> model inputs
        self._head_module: torch.nn.Module | None = None  # the output head the losses apply lazily
        self.layout = ParallelLayout(world=1)
        self.meshes: ParallelMeshes | None = None  # built by initialize()
        self._sp: SequenceParallel | None = None  # this rank's share of each micro-batch (sp_size > 1)
        self._moe_split: MoeTokenSplit | None = None  # this rank's share of a MoE block's tokens (tp_size > 1)
        # algorithm.routing_replay (set by whoever builds the engine): "r3" replays the server's MoE
        # routing (a micro-batch's ``routed_experts``) in every forward; "none" lets the router choose.
        self.routing_replay = "none"

    # ------------------------------------------------------------------ setup

    #: The config section the engine's settings come from (error messages name it).
    section = "actor"
    #: The LoRA adapters the engine trains on a frozen base (`LoraFSDPEngine`); None: the whole
    #: model trains. The layout checks refuse the splits adapters cannot take.
    lora: LoraConfig | None = None
    #: Makes the Hugging Face module from its directory and config (a subclass swaps the model).
    build_model = staticmethod(causal_lm)

    def initialize(self, total_steps: int | None = None) -> "FSDPEngine":
        """Join/create the process group, load and shard the model, build AdamW and the LR schedule.

        ``total_steps`` overrides ``optimizer.total_steps`` (training scripts
        know it from the data).
        """
        if self.model is not None:
            raise RuntimeError("FSDPEngine.initialize() was already called")
        path = Path(self.config.model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{self.section}.model_path={str(path)!r} has no config.json; it must be a Hugging Face "
                "model directory"
            )
        device_type = self._join_group()
        self.model, self.hf_config, n_layers = load_sharded_model(
            self.config, self.layout, self.meshes, self.dtype, device_type, self.frozen, build=self.build_model,
            section=self.section, lora=self.lora is not None,
        )
        vision = is_vision_config(self.hf_config)
        self.planner = MicroBatchPlanner(self.config.mb_max_tokens, self.device, _pad_id(self.hf_config),
                                         group=self.meshes.group, sp=self._sp,
                                         hf_config=self.hf_config if vision else None)
        # The loss applies the output head after the model's forward returns: the root's
        # parameters (the head's weight among them) must stay gathered until the backward.
        self.model.set_reshard_after_forward(False, recurse=False)
        if self.meshes.tp is not None:
            self._moe_split = split_moe_tokens(self.model, self.meshes.tp.get_group())
        self._head_module = output_head(self.model, self.hf_config)
        if self.config.router_aux_loss_coef > 0 and not moe_routers(self.model):
            raise ValueError(f"{self.section}.router_aux_loss_coef={self.config.router_aux_loss_coef}: the model has "
                             "no mixture-of-experts router to balance; set it to 0")
        if not self.frozen:
            self.optimizer, self.lr_scheduler = build_optimizer(self.model, self.config.optimizer, total_steps)
        logger.info(
            "FSDPEngine ready: rank %d/%d on %s, %d decoder layers sharded, dtype=%s, frozen=%s, layout %s",
            self.rank, self.world_size, device_type, n_layers, self.dtype, self.frozen, self.layout.describe(),
        )
        return self

    def _join_group(self) -> str:
        """Join (or create) the default process group; set rank, device, layout, meshes and
        compute dtype. Returns the device type."""
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
        self.layout = ParallelLayout.of(self.config, self.world_size)
        problems = engine_layout_problems(self.section, self.config, self.world_size, lora=self.lora is not None)
        if problems:
            raise layout_error(problems)
        self.meshes = build_meshes(self.layout, device_type)
        if self.meshes.sp is not None:
            self._sp = SequenceParallel(self.meshes.sp)
        self.dtype = compute_dtype(self.config.dtype, device_type)
        return device_type

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

    def _head(self, mb: dict | None, index: PackedIndex | None) -> HeadOutput:
        """The model's output on a packed micro-batch, head not yet applied (a `ChunkedHead`
        over the last hidden states ``[T, H]``), or its ``[T, ...]`` float32 output for a model
        without a plain output head (a value model); gathered from the sequence-parallel group."""
        kwargs, n_tokens = self.planner.model_inputs(mb, index)
        local = None if self._sp is None else self._sp.local_share
        if self._moe_split is not None:  # the MoE blocks route this rank's share of the forward's tokens
            local = self._moe_split.local_share if local is None else _then(local, self._moe_split.local_share)
        with (replay_routing(self.model, mb if self.routing_replay == "r3" else None, local),
              image_pass(self.model, self.planner.image_feed(mb))):
            if self._head_module is None:
                head = ChunkedHead.from_logits(self.model(**kwargs, use_cache=False).logits[0].float())
            else:
                with capture_head(self._head_module, take=lambda t: t[0]) as captured:
                    self.model(**kwargs, use_cache=False)
                head = captured[0]
        return head if self._sp is None else self._sp.whole(head, n_tokens)

    # ------------------------------------------------------------------ train

    def train_batch(self, batch: TrainBatch, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> dict[str, float]:
        """One optimizer step on ``batch`` (a right-padded ``[B, L]`` TensorDict or dict).

        ``loss_fn(head, mb)`` is the mean loss of one packed micro-batch
        (``head`` its `HeadOutput`: fused log-probs, or ``head.logits()``);
        ``loss_weight_fn(mb)`` its weight (e.g. its loss tokens).
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
        plan = self.planner.plan(self.planner.rows(batch).data)
        weights = [0.0 if mb is None else _as_weight(loss_weight_fn(mb)) for mb, _ in plan]
        total_weight, base = self._global_totals(plan, weights)

        self.optimizer.zero_grad(set_to_none=True)
        if total_weight <= 0:
            # Every rank sees the same global total, so all skip together.
            logger.warning("train_batch: total loss weight is 0 (nothing to learn from); step skipped")
            return {**base, "grad_norm": 0.0, "loss": 0.0, "skipped": 1.0}

        # FSDP2 averages gradients over the ranks it shards (and replicates) over; the sequence-
        # parallel ranks of a group each hold a part of one micro-batch's gradient, which that
        # average sums (the tensor-parallel ranks' parts are summed by DTensor).
        scale = self.layout.fsdp_size / total_weight
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        stat_sums: dict[str, list[float]] = {}
        for i, ((mb, index), w) in enumerate(zip(plan, weights)):
            # Reduce-scatter gradients once, after the last micro-batch.
            if not self.config.cpu_offload:
                self.model.set_requires_gradient_sync(i == len(plan) - 1)
            with self._load_balance() as balance:
                head = self._head(mb, index)
            if mb is None:
                aux = balance.loss() * 0.0 if balance else 0.0
                (head.logits().sum() * 0.0 + aux).backward()
                continue
            loss = _checked_loss(loss_fn(head, mb))
            objective = loss
            if balance:  # the reported loss stays the algorithm's; the stat says the balance
                aux = balance.loss()
                mb.setdefault("_stats", {})["router_aux_loss"] = aux.detach()
                objective = loss + self.config.router_aux_loss_coef * aux
            (objective * (w * scale)).backward()
            loss_sum += loss.detach().double() * w
            _add_stats(stat_sums, mb.get("_stats") or {}, w)
        self.model.set_requires_gradient_sync(True)
        if self._moe_split is not None:
            finish_moe_gradients(self.model, self._moe_split.group)
        if self.layout.ep > 1:
            finish_expert_gradients(self.model, self.meshes.ep_replicas, self.layout.fsdp_size)

        grad_norm, skipped = self._step_optimizer()
        dist.all_reduce(loss_sum)
        loss_sum /= self.layout.group_size  # each rank of a group counted the same micro-batches
        stats = {**base, "grad_norm": grad_norm, "loss": float(loss_sum) / total_weight, "skipped": float(skipped)}
        stats.update(self._reduce_stats(stat_sums))
        return stats

    def _global_totals(
        self, plan: list[PackedMicroBatch], weights: list[float]
    ) -> tuple[float, dict[str, float]]:
        """The loss weight summed over ranks, and the step's size figures (sums over ranks) and LR;
        a model-parallel group's micro-batches count once."""
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
        totals /= self.layout.group_size
        total_weight, n_tokens, n_computed, n_seqs = (float(x) for x in totals.tolist())
        return total_weight, {
            "lr": self.optimizer.param_groups[0]["lr"], "n_tokens": n_tokens, "n_tokens_computed": n_computed,
            "n_seqs": n_seqs, "n_mbs": float(len(plan)),
        }

    def _step_optimizer(self) -> tuple[float, bool]:
        """Clip, then step (optimizer and LR schedule) unless the gradient norm is not finite.
        Returns ``(grad_norm, skipped)``."""
        grad_norm = self._clip_grad_norm()
        skipped = not math.isfinite(grad_norm)
        if skipped:
            logger.warning("train_batch: non-finite gradient norm (%s); optimizer step skipped", grad_norm)
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.lr_scheduler.step()
            self._step += 1
        return grad_norm, skipped

    def _clip_grad_norm(self) -> float:
        """Global gradient norm (clipped to ``gradient_clipping`` if > 0)."""
        clip = self.config.optimizer.gradient_clipping
        return clip_grad_norm(list(self.model.parameters()), max_norm=clip if clip > 0 else float("inf"))

    def _reduce_stats(self, stat_sums: dict[str, list[float]]) -> dict[str, float]:
        """Weighted mean of loss-function stats over micro-batches and ranks (``*_max``: the maximum)."""
        if self.world_size > 1:
            gathered: list[dict[str, list[float]]] = [{}] * self.world_size  # filled by the collective
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

    def _load_balance(self) -> RouterLoadBalance | contextlib.nullcontext:
        """The routers' load-balancing loss of the training forward (``actor.router_aux_loss_coef``),
        or a context giving None when it is off."""
        if self.config.router_aux_loss_coef > 0:
            return RouterLoadBalance(self.model)
        return contextlib.nullcontext()

    # ---------------------------------------------------------------- forward

    @torch.no_grad()
    def forward(self, batch: TrainBatch, post_hook: PostHook, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Per-token values ``[B, L]`` without a graph (e.g. log-probs of the taken tokens).

        ``post_hook(head, mb) -> [T]`` scores ``labels`` (``head`` the
        micro-batch's `HeadOutput`); the value of
        ``labels[t]`` lands at the position of that token, so ``out[b, j]``
        belongs to ``input_ids[b, j]`` and position 0 of each row is 0.
        Runs in eval mode (the model's mode is restored after).
        """
        self._require()
        rows = self.planner.rows(batch)
        out = torch.zeros(rows.data["input_ids"].shape, dtype=out_dtype)
        was_training = self.model.training
        self.model.eval()
        try:
            for mb, index in self.planner.plan(rows.data):
                head = self._head(mb, index)
                if mb is None:
                    continue
                values = post_hook(head, mb)
                unpack(values.detach().to("cpu"), index, out)
        finally:
            self.model.train(was_training)
            if self.world_size > 1:
                self.model.reshard()  # no backward follows to reshard the root
        return rows.own(out).to(batch["input_ids"].device)

    # ------------------------------------------------------------ checkpoints

    def save(self, path: str | os.PathLike) -> None:
        """Sharded checkpoint (DCP): model, optimizer, LR schedule, RNG per rank, version, step."""
        self._require()
        extra = {
            "version": self._version,
            "step": self._step,
            "world_size": self.world_size,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
            **rng_state(self.device),
        }
        save_sharded(Path(path), self.model, self.optimizer, self.rank, extra)

    def load(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint written by ``save`` (DCP reshards if the world size changed)."""
        self._require()
        extra = load_sharded(Path(path), self.model, self.optimizer, self.rank)
        self._version = int(extra["version"])
        self._step = int(extra["step"])
        if self.lr_scheduler is not None and extra["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        if extra["world_size"] == self.world_size:
            restore_rng(extra, self.device)
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
        self._require()
        export_hf_dir(Path(path), self.model, self.rank, Path(self.config.model_path), self.hf_config)

    def named_weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full (unsharded) weights in HF names, in buckets of at most ``bucket_bytes``.

        A tensor larger than ``bucket_bytes`` makes a bucket of its own. Names and
        shapes are the checkpoint's (`arealite.utils.checkpoint_names`: a
        mixture-of-experts layer's fused experts go out one tensor per expert, as
        SGLang loads them). Tied weights appear once, under the name the HF
        safetensors file uses (``model.embed_tokens.weight``). Unsharding is a collective: EVERY rank
        must iterate the generator to the end in the same order, even if only
        rank 0 uses the tensors. At most one bucket is materialised at a time.
        """
        self._require()
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0 (weight_sync.bucket_size_mb)")
        skip = tied_duplicate_names(self.hf_config)

        def full_weights() -> Iterator[tuple[str, torch.Tensor]]:
            # named_parameters() yields a tied parameter once, under its first name.
            for name, p in self.model.named_parameters():
                if name in skip:
                    continue
                t = p.detach()
                if t.device != self.device:
                    t = t.to(self.device)  # CPU-offloaded shards: NCCL gathers on the GPU
                yield from checkpoint_tensors(self.model, name, whole_tensor(t))

        yield from buckets_of(full_weights(), bucket_bytes)


def _pad_id(hf_config) -> int:
    """The pad token id of a HF config (a vision-language model's may be in its text config)."""
    pad = getattr(hf_config, "pad_token_id", None)
    if pad is None and hasattr(hf_config, "get_text_config"):
        pad = getattr(hf_config.get_text_config(), "pad_token_id", None)
    return int(pad or 0)


def _checked_loss(loss: object) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError(
            f"loss_fn must return a 0-dim tensor (the micro-batch mean loss), got "
            f"{type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}"
        )
    return loss


def _add_stats(stat_sums: dict[str, list[float]], stats: MicroBatchStats, w: float) -> None:
    """Accumulate a micro-batch's stats: ``[weighted sum, weight]``, or ``[max, 1]`` for ``*_max`` keys."""
    for k, v in stats.items():
        v = float(v.detach() if isinstance(v, torch.Tensor) else v)
        if k.endswith("_max"):  # a maximum stays a maximum
            acc = stat_sums.setdefault(k, [-math.inf, 1.0])
            acc[0] = max(acc[0], v)
            continue
        acc = stat_sums.setdefault(k, [0.0, 0.0])
        acc[0] += v * w
        acc[1] += w


def _as_weight(w: float | torch.Tensor) -> float:
    """A micro-batch loss weight as a float; must be finite and >= 0."""
    value = float(w.detach().item()) if isinstance(w, torch.Tensor) else float(w)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"loss_weight_fn returned {value}; weights must be finite and >= 0")
    return value


def _then(first: Callable[[torch.Tensor], torch.Tensor],
          second: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``second(first(x))``: a share of a share (a MoE block's tensor-parallel share of the
    sequence-parallel share of a micro-batch)."""
    return lambda x: second(first(x))
