"""The critic: a value model on its own FSDP engine, trained on returns, checkpointed beside the actor."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from arealite.config.loader import ConfigError, load_config
from arealite.config.schema import ActorConfig, OptimizerConfig
from arealite.critic import Critic, ValueEngine, WithCritic

pytest.importorskip("arealite.train_engine.fsdp")


@pytest.fixture()
def value_engine(micro_model_dir):
    cfg = ActorConfig(model_path=str(micro_model_dir), mb_max_tokens=24,
                      optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.0, gradient_clipping=1.0))
    engine = ValueEngine(cfg, device="cpu").initialize()
    yield engine
    engine.destroy()


def _batch(seed=0, B=5, L=12):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([12, 7, 9, 4, 11])[:B]
    pos = torch.arange(L)[None, :]
    am = pos < lengths[:, None]
    lm = am & (pos >= 3)
    ids = torch.randint(5, 200, (B, L), generator=g) * am
    return TensorDict({"input_ids": ids, "attention_mask": am, "loss_mask": lm}, batch_size=[B])


def test_values_are_the_head_on_the_state_before_each_token_and_packing_does_not_leak(value_engine):
    batch = _batch()
    values = Critic(value_engine).compute_values(batch)
    assert values.shape == (5, 12) and (values[:, 0] == 0).all()
    model = value_engine.model
    with torch.no_grad():
        for b in range(5):
            n = int(batch["attention_mask"][b].sum())
            out = model(input_ids=batch["input_ids"][b : b + 1, :n]).logits[0, :, 0]
            # values[b, j] = V(state before token j) = head(hidden after token j - 1).
            assert torch.allclose(values[b, 1:n], out[: n - 1], atol=1e-5), b
            assert (values[b, n:] == 0).all()


def test_update_fits_the_returns_and_checkpoints_round_trip(value_engine, tmp_path):
    batch = _batch(seed=1)
    mask = batch["loss_mask"]
    batch["returns"] = torch.where(mask, torch.linspace(-1, 1, 12)[None, :].expand(5, 12), torch.zeros(()))
    critic = Critic(value_engine, value_clip=None)
    first = None
    for step in range(30):
        batch["values"] = critic.compute_values(batch)
        stats = critic.update(batch)
        first = first if first is not None else stats
        if step == 4:
            WithCritic(_NoActor(), value_engine).save(tmp_path / "ckpt")
            saved = critic.compute_values(batch)
    assert stats["value_loss"] < 0.3 * first["value_loss"]
    assert stats["explained_variance"] > 0.5 > first["explained_variance"]
    WithCritic(_NoActor(), value_engine).load(tmp_path / "ckpt")
    assert torch.allclose(critic.compute_values(batch), saved, atol=0)


class _NoActor:
    def save(self, path):
        path.mkdir(parents=True, exist_ok=True)

    def load(self, path):
        pass

    def set_version(self, v):
        pass


def test_update_without_returns_fails_clearly(value_engine):
    with pytest.raises(KeyError, match="returns"):
        Critic(value_engine).update(_batch())


def test_gae_and_the_critic_go_together_in_config():
    with pytest.raises(ConfigError, match=r"algorithm.adv_estimator = 'gae': needs a value model: set critic.enabled"):
        load_config(None, ["algorithm.adv_estimator=gae"], check_paths=False)
    with pytest.raises(ConfigError, match="critic.enabled = true: trains a value model"):
        load_config(None, ["critic.enabled=true"], check_paths=False)
    cfg = load_config(None, ["critic.enabled=true", "algorithm.adv_estimator=gae"], check_paths=False)
    assert cfg.critic.value_clip == 0.2


def test_the_critic_section_is_a_train_engine_config_and_reaches_the_engine_whole(micro_model_dir, monkeypatch):
    """Every train-engine key the actor has, the critic has with the same meaning; the builder
    hands the critic's section itself to its engine (the backbone defaulting to the actor's)."""
    from arealite.config.schema import CriticConfig, TrainEngineConfig
    from arealite.trainer.build import build_critic

    assert set(TrainEngineConfig.model_fields) <= set(CriticConfig.model_fields)
    assert set(TrainEngineConfig.model_fields) <= set(ActorConfig.model_fields)
    monkeypatch.setattr(ValueEngine, "initialize", lambda self, total_steps=None: self)
    overrides = ["critic.enabled=true", "algorithm.adv_estimator=gae", f"actor.model_path={micro_model_dir}",
                 "critic.sp_size=2", "critic.attn_impl=sdpa_loop", "critic.cpu_offload=true",
                 "critic.router_aux_loss_coef=0.01", "critic.mb_max_tokens=77", "critic.value_clip=0.3"]
    cfg = load_config(None, overrides, check_paths=False)
    critic = build_critic(cfg, total_steps=5)
    engine_cfg = critic.engine.config
    assert engine_cfg.model_path == str(micro_model_dir) and cfg.critic.model_path is None
    for name in TrainEngineConfig.model_fields:
        if name != "model_path":
            assert getattr(engine_cfg, name) == getattr(cfg.critic, name), name
    assert (engine_cfg.sp_size, engine_cfg.cpu_offload, engine_cfg.mb_max_tokens) == (2, True, 77)
    assert engine_cfg.optimizer.lr == 1e-5  # the critic's own default, not the actor's
    assert critic.value_clip == 0.3


def test_a_fresh_value_head_is_the_same_whatever_the_caller_seeded(micro_model_dir):
    """Each rank loads the value model itself: its fresh head must not depend on the process's
    RNG state (it did: FSDP2 then stitched the ranks' different heads into one)."""
    from transformers import AutoConfig

    from arealite.critic.engine import value_model

    heads = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        model = value_model(micro_model_dir, AutoConfig.from_pretrained(micro_model_dir))
        heads.append(model.score.weight.detach().clone())
    assert torch.equal(heads[0], heads[1]) and heads[0].abs().sum() > 0
    std = AutoConfig.from_pretrained(micro_model_dir).initializer_range
    assert 0.5 * std < heads[0].std().item() < 1.5 * std


@pytest.fixture(scope="module")
def critic_one_process(micro_model_dir, tmp_path_factory):
    """The critic's scenario (tests/_critic_worker.py) in this process, a world of one."""
    import importlib.util

    from fsdp_scenario import HERE

    spec = importlib.util.spec_from_file_location("_critic_worker", HERE / "_critic_worker.py")
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    out = tmp_path_factory.mktemp("critic_1rank")
    worker.run(str(micro_model_dir), str(out))
    return torch.load(out / "critic_rank0.pt", weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["sp", "tp"])
def test_the_critic_under_a_parallel_layout_matches_one_process(layout, critic_one_process, micro_model_dir,
                                                                tmp_path_factory):
    """critic.sp_size / critic.tp_size = 2 on two ranks: the same fresh head, the same values
    of each rank's rows, the same value losses and gradient norms for three steps, the same head
    after them (within 1e-5, fp32)."""
    from fsdp_scenario import HERE, max_diff, two_ranks

    _, (r0, r1) = two_ranks(micro_model_dir, tmp_path_factory.mktemp(f"critic_{layout}2"), layout,
                            worker=HERE / "_critic_worker.py", result="critic_rank{}.pt")
    single = critic_one_process
    assert max_diff(r0["head"], single["head"]) == 0.0 and max_diff(r1["head"], single["head"]) == 0.0
    for key in ("first_values", "values"):
        assert (torch.cat([r0[key], r1[key]]) - single[key]).abs().max().item() <= 1e-5, key
    for s2, s1 in zip(r0["stats"], single["stats"]):
        assert abs(s2["value_loss"] - s1["value_loss"]) <= 1e-5 and abs(s2["grad_norm"] - s1["grad_norm"]) <= 1e-5
    assert max_diff(r0["head_after"], single["head_after"]) <= 1e-5 and max_diff(r0["head_after"], r1["head_after"]) == 0
