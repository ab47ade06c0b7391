"""LoRA on the FSDP2 engine (one process, CPU): what trains, the reference, export, resume, bad configs."""

from __future__ import annotations

import json
import random

import pytest
import torch

from arealite.config.schema import ActorConfig, ArealiteConfig, LoraConfig
from arealite.lora import AdapterOffReference, LoraFSDPEngine
from tests.test_fsdp import LENGTHS, label_logp, make_batch, n_tokens, token_mean_ce


def lora_cfg(model_dir, **lora) -> ActorConfig:
    cfg = ActorConfig(model_path=str(model_dir), mb_max_tokens=24,
                      lora=LoraConfig(rank=4, alpha=8.0, **lora))
    cfg.optimizer.lr = 1e-2
    return cfg


@pytest.fixture
def make_lora(micro_model_dir):
    engines = []

    def _make(**kw):
        e = LoraFSDPEngine(lora_cfg(micro_model_dir, **kw), device="cpu").initialize(total_steps=10)
        engines.append(e)
        return e

    yield _make
    for e in reversed(engines):
        e.destroy()


def hf_logp(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]


def test_only_adapters_train_and_have_optimizer_state(make_lora):
    e = make_lora()
    before = {n: p.detach().clone() for n, p in e.model.named_parameters()}
    batch = make_batch(e.hf_config.vocab_size, LENGTHS)
    stats = e.train_batch(batch, token_mean_ce, n_tokens)
    assert stats["n_mbs"] >= 3 and stats["grad_norm"] > 0 and stats["skipped"] == 0
    changed = {n for n, p in e.model.named_parameters() if not torch.equal(p.detach(), before[n])}
    lora = {n for n, _ in e.model.named_parameters() if ".lora_" in n}
    assert changed and changed <= lora and any(".lora_B." in n for n in changed)
    trainable = {id(p) for n, p in e.model.named_parameters() if p.requires_grad}
    assert trainable == {id(p) for n, p in e.model.named_parameters() if n in lora}
    assert {id(p) for p in e.optimizer.state} <= trainable and len(e.optimizer.state) == len(lora)


def test_clipping_bounds_the_adapter_gradient(make_lora):
    e = make_lora()
    e.config.optimizer.gradient_clipping = 1e-4
    batch = make_batch(e.hf_config.vocab_size, LENGTHS, seed=3)
    stats = e.train_batch(batch, token_mean_ce, n_tokens)
    grads = [p.grad for p in e.model.parameters() if p.grad is not None]
    assert stats["grad_norm"] > 1e-4
    assert torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item() <= 1e-4 * 1.001


def test_forward_equals_peft_reference_and_reference_is_the_base(make_lora, micro_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    e = make_lora()
    batch = make_batch(e.hf_config.vocab_size, LENGTHS, seed=1)
    for _ in range(2):
        e.train_batch(batch, token_mean_ce, n_tokens)
    e.export_hf(tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and "q_proj" in cfg["target_modules"]

    base = AutoModelForCausalLM.from_pretrained(micro_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    base_logp = hf_logp(base, batch)
    ref = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    am = batch["attention_mask"][:, 1:]
    with torch.no_grad():
        want = hf_logp(ref, batch)
    got = e.forward(batch, label_logp)[:, 1:]
    assert (got - want)[am].abs().max().item() <= 1e-5
    assert (got - base_logp.detach())[am].abs().max().item() > 1e-3  # the adapter changed something

    off = e.reference().forward(batch, label_logp)[:, 1:]
    assert isinstance(e.reference(), AdapterOffReference)
    assert (off - base_logp.detach())[am].abs().max().item() <= 1e-5
    assert torch.equal(e.forward(batch, label_logp)[:, 1:], got)  # adapters back on after


def test_merged_export_and_merged_buckets_score_as_the_adapter(make_lora, tmp_path):
    from transformers import AutoModelForCausalLM

    e = make_lora()
    batch = make_batch(e.hf_config.vocab_size, LENGTHS, seed=2)
    e.train_batch(batch, token_mean_ce, n_tokens)
    e.export_hf(tmp_path / "merged", merged=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32,
                                                  attn_implementation="sdpa")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    am = batch["attention_mask"][:, 1:]
    with torch.no_grad():
        want = hf_logp(merged, batch)
    got = e.forward(batch, label_logp)[:, 1:]
    assert (got - want)[am].abs().max().item() <= 1e-5
    names = {n for b in e.named_weight_buckets(1 << 20) for n, _ in b}
    assert names == set(merged.state_dict()) - {"lm_head.weight"} or names == set(merged.state_dict())


def test_resume_restores_adapter_and_optimizer(micro_model_dir, tmp_path):
    def engine():
        return LoraFSDPEngine(lora_cfg(micro_model_dir), device="cpu").initialize(total_steps=10)

    a = engine()
    batch = make_batch(a.hf_config.vocab_size, LENGTHS)
    for _ in range(2):
        a.train_batch(batch, token_mean_ce, n_tokens)
    a.set_version(2)
    a.save(tmp_path / "ckpt")
    losses_a = [a.train_batch(batch, token_mean_ce, n_tokens)["loss"] for _ in range(2)]
    adapter_a = {n: t.clone() for b in a.adapter_buckets(1 << 20) for n, t in b}
    a.destroy()

    b = engine()
    torch.manual_seed(7)
    random.seed(7)
    b.load(tmp_path / "ckpt")
    assert b.get_version() == 2 and b.step_count == 2
    assert len(b.optimizer.state) == len(adapter_a)  # Adam moments came back
    losses_b = [b.train_batch(batch, token_mean_ce, n_tokens)["loss"] for _ in range(2)]
    adapter_b = {n: t for bk in b.adapter_buckets(1 << 20) for n, t in bk}
    assert losses_b == losses_a
    assert adapter_a.keys() == adapter_b.keys() and all(torch.equal(adapter_a[n], adapter_b[n]) for n in adapter_a)
    assert all(n.startswith("base_model.model.") and ".default." not in n for n in adapter_a)
    b.destroy()


def test_unknown_target_module_lists_the_models_modules(micro_model_dir):
    e = LoraFSDPEngine(lora_cfg(micro_model_dir, target_modules=["q_proj", "qkv"]), device="cpu")
    with pytest.raises(ValueError) as info:
        e.initialize()
    msg = str(info.value)
    assert "actor.lora.target_modules" in msg and "'qkv'" in msg and "down_proj" in msg and "q_proj" in msg
    e.destroy()


def test_lora_engine_needs_lora_settings(micro_model_dir):
    with pytest.raises(ValueError, match="actor.lora is null"):
        LoraFSDPEngine(ActorConfig(model_path=str(micro_model_dir)), device="cpu")


def test_sglang_launch_flags_follow_actor_lora(micro_model_dir):
    from arealite.server.command_line import sglang_server_command

    cfg = ArealiteConfig.model_validate({"actor": {"model_path": str(micro_model_dir)}})
    assert "--enable-lora" not in sglang_server_command(cfg, 30000)
    cfg.actor.lora = LoraConfig(rank=8, target_modules=["q_proj", "v_proj"])
    cmd = sglang_server_command(cfg, 30000)
    i = cmd.index("--enable-lora")
    assert cmd[i:i + 6] == ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj"]


@pytest.mark.parametrize("override, field, says", [
    ({"rank": 0}, "actor.lora.rank", "greater than or equal to 1"),
    ({"alpha": -1}, "actor.lora.alpha", "greater than 0"),
    ({"dropout": 1.0}, "actor.lora.dropout", "less than 1"),
    ({"target_modules": []}, "actor.lora.target_modules", "at least 1"),
    ({"target_modules": ["q proj"]}, "actor.lora.target_modules", "not a module name"),
    ({"target_modules": ["q_proj", "q_proj"]}, "actor.lora.target_modules", "twice"),
    ({"rnak": 4}, "actor.lora.rnak", "rank, alpha, dropout, target_modules"),
])
def test_bad_lora_configs_name_the_field(tmp_path, override, field, says):
    import yaml

    from arealite.config.loader import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"actor": {"lora": override}}))
    with pytest.raises(ConfigError) as info:
        load_config(path, check_paths=False)
    assert field in str(info.value) and says in str(info.value)


def test_a_merged_export_without_lora_is_a_config_error(tmp_path):
    import yaml

    from arealite.config.loader import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"saver": {"export_merged_at_end": True}}))
    with pytest.raises(ConfigError, match="saver.export_merged_at_end.*actor.lora is null"):
        load_config(path, check_paths=False)
    path.write_text(yaml.safe_dump({"saver": {"export_merged_at_end": True}, "actor": {"lora": {"rank": 4}}}))
    assert load_config(path, check_paths=False).saver.export_merged_at_end
