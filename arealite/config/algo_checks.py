"""Algorithm settings that make no sense together, found before anything starts.

`algorithm_problems` judges the `algorithm` section alone (`PPOActor` calls it too, so a
config built in code is held to the same rules); `check_algorithm` adds the rules that
involve other sections and is one of the loader's cross-field checks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from arealite.config.problems import ConfigProblem

if TYPE_CHECKING:
    from arealite.config.schema import AlgorithmConfig, ArealiteConfig

__all__ = ["algorithm_problems", "raise_algorithm_problems", "check_algorithm"]

#: Estimators defined with advantage whitening over the global batch (REINFORCE++).
_GLOBAL_NORM = ("reinforce_pp", "reinforce_pp_baseline")
_SEQUENCE_LOSSES = ("gspo", "gspo_token")


def algorithm_problems(alg: "AlgorithmConfig") -> list[ConfigProblem]:
    """What is wrong inside the `algorithm` section (dotted paths under `algorithm.`)."""
    out: list[ConfigProblem] = []
    if alg.kl_in_reward and alg.kl_coef <= 0:
        out.append(ConfigProblem("algorithm.kl_in_reward", "needs algorithm.kl_coef > 0 (the weight of the KL "
                                 "penalty put in the reward); set kl_coef or kl_in_reward: false", True))
    if alg.adv_estimator in _GLOBAL_NORM and alg.adv_norm != "batch":
        out.append(ConfigProblem("algorithm.adv_norm", f"must be `batch` with adv_estimator={alg.adv_estimator}: "
                                 "REINFORCE++ whitens advantages over the global batch", alg.adv_norm))
    if alg.mismatch.mode != "none" and not alg.use_decoupled_loss:
        out.append(ConfigProblem("algorithm.mismatch.mode", "needs the trainer's own log-probs of the batch: set "
                                 "algorithm.use_decoupled_loss: true (or mismatch.mode: none)", alg.mismatch.mode))
    if alg.policy_loss in _SEQUENCE_LOSSES and alg.c_clip is not None:
        out.append(ConfigProblem("algorithm.c_clip", f"dual clip is part of the token-level `ppo` loss, not of "
                                 f"policy_loss={alg.policy_loss}: set c_clip: null", alg.c_clip))
    return out


def raise_algorithm_problems(alg: "AlgorithmConfig") -> None:
    """Raise ``ValueError`` listing `algorithm_problems`, if any."""
    problems = algorithm_problems(alg)
    if problems:
        raise ValueError("; ".join(f"{p.path} = {p.value!r}: {p.message}" for p in problems))


def check_algorithm(cfg: "ArealiteConfig") -> list[ConfigProblem]:
    """The `algorithm` section's rules, and: `adv_estimator: gae` if and only if `critic.enabled`;
    `algorithm.overlong.buffer_len` <= `generation.max_new_tokens`; `evaluation.n_samples` > 1
    needs `data.eval_path`."""
    out = algorithm_problems(cfg.algorithm)
    alg = cfg.algorithm
    if alg.adv_estimator == "gae" and not cfg.critic.enabled:
        out.append(ConfigProblem("algorithm.adv_estimator", "needs a value model: set critic.enabled: true "
                                 "(or pick a critic-free estimator such as grpo)", "gae"))
    if cfg.critic.enabled and alg.adv_estimator != "gae":
        out.append(ConfigProblem("critic.enabled", f"trains a value model that only algorithm.adv_estimator=gae "
                                 f"uses, not {alg.adv_estimator}: set critic.enabled: false or adv_estimator: gae",
                                 True))
    buf = alg.overlong.buffer_len
    if buf is not None and buf > cfg.generation.max_new_tokens:
        out.append(ConfigProblem("algorithm.overlong.buffer_len", "must be <= generation.max_new_tokens = "
                                 f"{cfg.generation.max_new_tokens} (the penalty ramps up inside the length limit)",
                                 buf))
    if cfg.evaluation.n_samples > 1 and not cfg.data.eval_path:
        out.append(ConfigProblem("evaluation.n_samples", "is > 1 but data.eval_path is not set: set it to the "
                                 "held-out prompts, or evaluation.n_samples: 1", cfg.evaluation.n_samples))
    return out
