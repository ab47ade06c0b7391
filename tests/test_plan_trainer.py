"""The planner's trainer memory (arealite.plan.model_shapes, activations, trainer_memory): the
inventory is the real model's, layouts shrink the parts the engine really splits, and the
prediction of a world of one matches the measured peak of live tensor bytes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from arealite.config.schema import ArealiteConfig
from arealite.plan.model_shapes import model_shapes
from arealite.plan.trainer_memory import trainer_rank_memory

PARAMS = "parameters (fp32 shard)"


def _cfg(model_dir, world: int = 1, **actor) -> ArealiteConfig:
    return ArealiteConfig.model_validate({"actor": {"model_path": str(model_dir), "mb_max_tokens": 256, **actor},
                                          "launch": {"n_trainer_procs": world}})


def test_inventory_is_the_real_models_parameters(micro_model_dir):
    from transformers import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_pretrained(micro_model_dir)
    shapes = model_shapes(micro_model_dir)
    named = dict(real.named_parameters())
    assert len(shapes.params) == len(named)
    assert {p.name: p.shape for p in shapes.params} == {n: tuple(p.shape) for n, p in named.items()}
    assert 4 * shapes.numel == sum(p.numel() * p.element_size() for p in named.values())
    assert shapes.tied and shapes.n_layers == 2
    roles = shapes.by_role()
    assert roles["embedding"] == real.model.embed_tokens.weight.numel() and "head" not in roles  # tied


def test_roles_and_splits_of_a_moe_and_of_lora(tmp_path_factory, micro_model_dir):
    from arealite.config.schema import LoraConfig
    from arealite.models.tiny import build_tiny_model

    moe = model_shapes(build_tiny_model(tmp_path_factory.mktemp("moe"), size="moe-micro"))
    experts = [p for p in moe.params if p.role == "experts"]
    assert experts and all(p.split == "experts" and p.shape[0] == 8 for p in experts)
    assert {p.role for p in moe.params if p.name.endswith("mlp.gate.weight")} == {"router"}
    lora = model_shapes(micro_model_dir, lora=LoraConfig(rank=4))
    trainable = [p for p in lora.params if p.trainable]
    assert trainable and all(p.role == "lora" for p in trainable)


def test_a_config_only_directory_plans(micro_model_dir, tmp_path):
    shutil.copy(micro_model_dir / "config.json", tmp_path / "config.json")
    plan = trainer_rank_memory(_cfg(tmp_path), device="cpu", seq_lens=[128, 128], n_microbatches=1)
    assert plan.total > 0 and plan.parts[PARAMS] == 4 * model_shapes(micro_model_dir).numel
    as_dict = json.loads((micro_model_dir / "config.json").read_text())
    again = trainer_rank_memory(_cfg(tmp_path), hf_config=as_dict, device="cpu", seq_lens=[128, 128],
                                n_microbatches=1)
    assert again.total == plan.total


def test_layouts_shrink_what_the_engine_splits(micro_model_dir):
    shapes = model_shapes(micro_model_dir)
    by = shapes.by_role()
    layers, root = by["attention"] + by["mlp"], by["embedding"] + by["final_norm"]
    kw = dict(device="cpu", seq_lens=[128, 128], n_microbatches=1, shapes=shapes)
    one = trainer_rank_memory(_cfg(micro_model_dir), **kw).parts[PARAMS]
    # tp=2 on 2 ranks: the projections halve, the embedding, norms and biases of row layers stay whole
    tp = trainer_rank_memory(_cfg(micro_model_dir, world=2, tp_size=2), **kw).parts[PARAMS]
    row_bias = sum(p.numel for p in shapes.params if p.split == "row" and len(p.shape) == 1)
    assert tp == 4 * (root + by["norm"] + (layers - row_bias) // 2 + row_bias)
    # dp=2: FSDP2 halves every parameter's dim 0 (padded up)
    dp = trainer_rank_memory(_cfg(micro_model_dir, world=2), **kw).parts[PARAMS]
    assert dp == 4 * sum(-(-p.shape[0] // 2) * (p.numel // p.shape[0]) for p in shapes.params)
    # sp=2 shards like dp=2 and halves each rank's tokens: less activation memory
    sp = trainer_rank_memory(_cfg(micro_model_dir, world=2, sp_size=2), **kw)
    assert sp.parts[PARAMS] == dp
    whole = trainer_rank_memory(_cfg(micro_model_dir, world=2), **kw)
    assert sp.parts.get("activations", 0) < whole.parts.get("activations", 0)


def test_checkpointing_keeps_less_and_lora_trains_only_adapters(micro_model_dir):
    kw = dict(device="cpu", seq_lens=[256], n_microbatches=1)
    plain = trainer_rank_memory(_cfg(micro_model_dir), **kw)
    ckpt = trainer_rank_memory(_cfg(micro_model_dir, gradient_checkpointing=True), **kw)
    assert ckpt.parts["activations"] < plain.parts["activations"] / 2
    from arealite.config.schema import LoraConfig

    lora = trainer_rank_memory(_cfg(micro_model_dir, lora={"rank": 4}), **kw)
    adapters = model_shapes(micro_model_dir, lora=LoraConfig(rank=4)).by_role()["lora"]
    assert lora.parts["optimizer (AdamW, fp32)"] == 8 * adapters  # the base is frozen: no state


def test_bf16_on_a_gpu_halves_the_traced_activations(micro_model_dir):
    kw = dict(seq_lens=[256], n_microbatches=1)
    cpu = trainer_rank_memory(_cfg(micro_model_dir), device="cpu", **kw)
    gpu = trainer_rank_memory(_cfg(micro_model_dir), device="cuda", **kw)
    assert gpu.parts[PARAMS] == cpu.parts[PARAMS]  # fp32 master weights either way
    assert 0.4 < gpu.parts["activations"] / cpu.parts["activations"] < 0.6


def test_prediction_matches_the_measured_peak_in_process(micro_model_dir):
    from arealite.plan.measured import step_peak
    from arealite.train_engine.fsdp import FSDPEngine

    cfg = _cfg(micro_model_dir)
    engine = FSDPEngine(cfg.actor, device="cpu").initialize(total_steps=4)
    try:
        ids = torch.randint(10, 500, (2, 128), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids, dtype=torch.bool)
        batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask}

        def nll(head, mb):
            return -head.logprobs(mb["labels"]).mean()

        def weight(mb):
            return mb["loss_mask"].sum()

        engine.train_batch(batch, nll, weight)  # AdamW's state exists from here on
        measured = step_peak(engine, batch, nll, weight)["peak"]
    finally:
        engine.destroy()
    predicted = trainer_rank_memory(cfg, device="cpu", seq_lens=[128, 128], n_microbatches=1).total
    assert abs(predicted - measured) / measured < 0.10, (predicted, measured)


def test_bad_section_and_missing_model_are_named(micro_model_dir):
    with pytest.raises(ValueError, match="section"):
        trainer_rank_memory(_cfg(micro_model_dir), section="ref")
    with pytest.raises(ValueError, match="actor.model_path"):
        trainer_rank_memory(ArealiteConfig(), device="cpu")
