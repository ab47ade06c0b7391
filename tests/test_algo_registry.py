"""Advantage estimators and policy losses named in config: a built-in short name or `module:function`.

The custom pair lives outside the package (tests/custom_algo_example.py), is named
in a YAML file, goes through the config loader, and drives a real ``ppo_update``
on the FSDP engine.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from transformers import AutoTokenizer

import tests.custom_algo_example as custom
from arealite.algo import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    PPOActor,
    advantage_estimator,
    broadcast_to_tokens,
    group_advantages,
    policy_loss,
)
from arealite.algo.loss import bind_policy_loss
from arealite.check import load_run_config
from arealite.config import ConfigError
from arealite.config.schema import AlgorithmConfig

from tests.test_algo_actor import make_batch

fsdp = pytest.importorskip("arealite.train_engine.fsdp")


def test_the_builtins_are_registered_by_their_config_names():
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "drgrpo", "rloo", "none", "reinforce_pp", "reinforce_pp_baseline"}
    assert set(POLICY_LOSSES) == {"ppo", "gspo", "gspo_token"}
    cfg = AlgorithmConfig()
    assert (cfg.adv_estimator, cfg.policy_loss) == ("grpo", "ppo")


def test_custom_estimator_and_loss_named_in_yaml_drive_a_real_update(tmp_path, micro_model_dir):
    path = tmp_path / "cfg.yaml"
    path.write_text(textwrap.dedent(f"""\
        actor:
          model_path: {micro_model_dir}
          mb_max_tokens: 24
          optimizer: {{lr: 2.0e-3, weight_decay: 0.0}}
        algorithm:
          adv_estimator: tests.custom_algo_example:baseline_advantages
          policy_loss: tests.custom_algo_example:reinforce_loss
          use_decoupled_loss: false
        """))
    cfg = load_run_config(path, check_paths=False)
    custom.CALLS.clear()
    engine = fsdp.FSDPEngine(cfg.actor, device="cpu").initialize(total_steps=10)
    try:
        actor = PPOActor(cfg.algorithm, engine, temperature=1.0)
        batch = make_batch(AutoTokenizer.from_pretrained(micro_model_dir).vocab_size, seed=1)
        mask = batch["loss_mask"]
        before = actor.compute_logp(batch)
        batch["logprobs"] = torch.where(mask, before, torch.zeros(()))
        rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0])
        batch["rewards"] = rewards

        actor.compute_advantages(batch)
        assert custom.CALLS == [("baseline_advantages", (8,))]
        # The fixed baseline, not GRPO's group standardisation.
        torch.testing.assert_close(batch["advantages"], broadcast_to_tokens(rewards - custom.BASELINE, mask))
        grpo = broadcast_to_tokens(group_advantages(rewards, batch["group_id"], "grpo"), mask)
        assert not torch.allclose(batch["advantages"], grpo)

        stats = actor.ppo_update(batch)[0]
        n_loss_calls = sum(name == "reinforce_loss" for name, _ in custom.CALLS)
        assert n_loss_calls == stats["n_mbs"] > 1  # once per micro-batch
        adv = batch["advantages"]
        # REINFORCE's -mean(A * logp) over the loss tokens; PPO's surrogate at ratio 1 would be -mean(A).
        want = float(-(adv * before)[mask].mean())
        assert abs(stats["loss"] - want) < 1e-4, (stats["loss"], want)
        assert abs(stats["loss"] - float(-adv[mask].mean())) > 0.1
        assert "reinforce_logp_mean" in stats and "clip_frac_low" not in stats
        assert engine.step_count == 1 and stats["grad_norm"] > 0
    finally:
        engine.destroy()


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("adv_estimator", "grpoo",
         "built-in advantage estimator (drgrpo, grpo, none, reinforce_pp, reinforce_pp_baseline, rloo)"),
        ("policy_loss", "ppo2", "built-in policy loss (gspo, gspo_token, ppo)"),
        ("adv_estimator", "tests.custom_algo_example:missing", "has no attribute 'missing'"),
        ("policy_loss", "no_such_pkg.losses:mine", "cannot import module 'no_such_pkg.losses'"),
        ("policy_loss", "tests.custom_algo_example:NOT_CALLABLE", "not a callable"),
        ("adv_estimator", "tests.custom_algo_example:reinforce_loss", "cannot be called as fn(rewards, group_id)"),
    ],
    ids=["unknown-estimator", "unknown-loss", "missing-attr", "missing-module", "not-callable", "wrong-arity"],
)
def test_a_bad_name_is_a_config_error_naming_field_value_and_choices(tmp_path, field, value, needle):
    path = tmp_path / "cfg.yaml"
    path.write_text(f"algorithm:\n  {field}: {value}\n")
    with pytest.raises(ConfigError) as info:
        load_run_config(path, check_paths=False)
    msg = str(info.value)
    assert f"algorithm.{field} = {value!r}" in msg and needle in msg, msg
    # Overrides go through the same check, and so does a config built in code, when the actor is made.
    with pytest.raises(ConfigError, match=f"algorithm.{field}"):
        load_run_config(None, [f"algorithm.{field}={value}"], check_paths=False)
    cfg = AlgorithmConfig()
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=field):
        PPOActor(cfg, None, 1.0)  # type: ignore[arg-type]  # fails before it needs an engine


def test_a_new_builtin_is_one_decorated_function():
    @advantage_estimator("sign")
    def sign_advantages(rewards, group_id):
        return torch.sign(rewards - rewards.mean())

    @policy_loss("neg_adv")
    def neg_adv(logp, prox_logp, advantages, loss_mask, behav_logp, config):
        return -advantages * logp, {}

    try:
        cfg = AlgorithmConfig(adv_estimator="sign", policy_loss="neg_adv")
        actor = PPOActor(cfg, None, 1.0)  # type: ignore[arg-type]  # advantages only: no engine needed
        assert actor.adv_estimator is sign_advantages and actor.policy_loss is neg_adv
        got = group_advantages(torch.tensor([1.0, 3.0]), torch.zeros(2, dtype=torch.long), "sign")
        assert got.tolist() == [-1.0, 1.0]
        with pytest.raises(ValueError, match="drgrpo, grpo, none, reinforce_pp, reinforce_pp_baseline, rloo, sign"):
            PPOActor(AlgorithmConfig(adv_estimator="nope"), None, 1.0)  # type: ignore[arg-type]
    finally:
        del ADVANTAGE_ESTIMATORS["sign"], POLICY_LOSSES["neg_adv"]
    with pytest.raises(ValueError, match="'sign' is neither"):
        PPOActor(AlgorithmConfig(adv_estimator="sign"), None, 1.0)  # type: ignore[arg-type]


def test_custom_functions_that_return_the_wrong_shape_fail_clearly():
    with pytest.raises(ValueError, match=r"shape \(3,\).*one value per trajectory"):
        group_advantages(torch.zeros(3), torch.zeros(3, dtype=torch.long), lambda r, g: r[:2])
    bound = bind_policy_loss(lambda lp, p, a, m, b, c: (lp.sum(), {}), AlgorithmConfig())
    t = torch.zeros(4)
    with pytest.raises(ValueError, match="must be per token"):
        bound(t, t, t, t.bool(), None)
