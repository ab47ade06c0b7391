"""Algorithm settings that make no sense together, found before anything starts.

`algorithm_problems` judges the `algorithm` section alone (`PPOActor` calls it too, so a
config built in code is held to the same rules); `check_algorithm` adds the rules that
involve other sections and is one of the loader's cross-field checks. Among them, what
the algorithm's trainer needs of SGLang servers (`sglang_server_problems`): one
weight-update rank per tensor-parallel rank (no pipeline stages), and LoRA modules that
SGLang can serve.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from arealite.config.problems import ConfigProblem

if TYPE_CHECKING:
    from arealite.config.schema import AlgorithmConfig, ArealiteConfig

__all__ = ["SGLANG_LORA_TARGET_MODULES", "algorithm_problems", "raise_algorithm_problems", "check_algorithm",
           "sglang_server_problems"]

#: Estimators defined with advantage whitening over the global batch (REINFORCE++).
_GLOBAL_NORM = ("reinforce_pp", "reinforce_pp_baseline")
_SEQUENCE_LOSSES = ("gspo", "gspo_token")

#: The names SGLang accepts for ``--lora-target-modules`` (``SUPPORTED_LORA_TARGET_MODULES`` in
#: ``srt/utils/common.py``, the same in 0.5.21 and 0.5.23; ``all`` aside, which PEFT does not know).
SGLANG_LORA_TARGET_MODULES = (
    "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj",
    "wq_b", "wk", "weights_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj",
    "embed_tokens", "lm_head", "qkvr", "wo_ud",
)
#: SGLang's pipeline-parallel size flag and its alias (``srt/arg_groups/fields/parallel.py``);
#: every other ``--pp-*`` flag tunes the pipeline too.
_PIPELINE_SIZE_FLAGS = ("--pp-size", "--pipeline-parallel-size")


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
    needs `data.eval_path`; no pipeline-parallel flag in `server.sglang.extra_args`; with
    `launch.server_backend: sglang`, `actor.lora.target_modules` among SGLang's LoRA module names."""
    out = algorithm_problems(cfg.algorithm) + sglang_server_problems(cfg)
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
    if cfg.evaluation.n_samples > 1 and not cfg.data.has_held_out:
        out.append(ConfigProblem("evaluation.n_samples", "is > 1 but data.eval_path is not set: set it to the "
                                 "held-out prompts, or evaluation.n_samples: 1", cfg.evaluation.n_samples))
    return out


def sglang_server_problems(cfg: "ArealiteConfig") -> list[ConfigProblem]:
    """What SGLang servers could not do for this run: pipeline stages (`server.sglang.extra_args`),
    LoRA modules outside SGLang's list (`actor.lora.target_modules`, SGLang backend only; the
    embedded server adapts whatever linear modules the model has)."""
    out = _pipeline_problems(cfg.server.sglang.extra_args)
    lora = cfg.actor.lora
    if lora is not None and cfg.launch.server_backend == "sglang":
        unknown = [m for m in lora.target_modules if m not in SGLANG_LORA_TARGET_MODULES]
        if unknown:
            out.append(ConfigProblem(
                "actor.lora.target_modules", f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not "
                "among the module names SGLang's --lora-target-modules accepts (its server would refuse to "
                f"start): pick from {', '.join(SGLANG_LORA_TARGET_MODULES)}", list(lora.target_modules)))
    return out


def _pipeline_problems(extra_args: list[str]) -> list[ConfigProblem]:
    """Pipeline-parallel flags in SGLang's extra arguments (`--pp-size 1` alone is harmless).

    A server joins the weight-update group as ranks ``rank_offset + tp_rank`` (SGLang's model
    runner), and the group's world size counts ``tp_size`` ranks per server: the stages of a
    pipeline would claim the same ranks, and the rendezvous would never complete.
    """
    out = []
    for i, arg in enumerate(extra_args):
        name, eq, inline = arg.partition("=")
        if name in _PIPELINE_SIZE_FLAGS:
            value = inline if eq else (extra_args[i + 1] if i + 1 < len(extra_args) else "")
            if value.strip() == "1":
                continue
            shown = arg if eq else f"{arg} {value}".strip()
        elif name.startswith("--pp-") or name.startswith("--pipeline-parallel"):
            shown = arg
        else:
            continue
        out.append(ConfigProblem(
            "server.sglang.extra_args", f"{shown}: SGLang's pipeline parallelism is not supported: the "
            "weight-update group gives each server one rank per tensor-parallel rank (rank_offset + tp_rank), "
            "which the stages of a pipeline would share; drop the flag and use server.sglang.tp_size, or more "
            "servers (launch.n_servers)", list(extra_args)))
    return out
