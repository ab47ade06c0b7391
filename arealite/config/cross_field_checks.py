"""Rules across a config's fields and sections, judged on a validated config before anything
starts: batch sizes against trainer ranks, prompt and answer lengths against the context,
evaluation settings against held-out data, and the like (`CROSS_FIELD_CHECKS`, each rule's
docstring listed in docs/config_reference.md; the algorithm's own rules are `algo_checks`).
`config_problems` runs them with the path checks and any checks of the packages above config.
"""

from __future__ import annotations

from collections.abc import Sequence

from arealite.config.algo_checks import check_algorithm
from arealite.config.placement_checks import check_placement
from arealite.config.path_checks import PATH_FIELDS, path_problems
from arealite.config.problems import ConfigCheck, ConfigError, ConfigProblem
from arealite.config.schema import ArealiteConfig

__all__ = ["CROSS_FIELD_CHECKS", "check_config", "config_advice", "config_problems"]


def _check_batch_divisible(cfg: ArealiteConfig) -> list[ConfigProblem]:
    """`rollout.consumer_batch_size` is divisible by `launch.n_trainer_procs` (every rank trains an equal share)."""
    b, n = cfg.rollout.consumer_batch_size, cfg.launch.n_trainer_procs
    if b % n:
        return [ConfigProblem(
            "rollout.consumer_batch_size", f"must be divisible by launch.n_trainer_procs = {n} "
            f"(each rank trains an equal share); e.g. {max(n, b - b % n)} or {b + n - b % n}", b,
        )]
    return []


def _check_rloo_group(cfg: ArealiteConfig) -> list[ConfigProblem]:
    """`algorithm.adv_estimator: rloo` needs `generation.n_samples` >= 2 (leave-one-out needs another sample)."""
    if cfg.algorithm.adv_estimator == "rloo" and cfg.generation.n_samples < 2:
        return [ConfigProblem(
            "generation.n_samples", "must be >= 2 with algorithm.adv_estimator = rloo "
            "(the leave-one-out baseline of a group of 1 is undefined)", cfg.generation.n_samples,
        )]
    return []


def _check_eval_needs_data(cfg: ArealiteConfig) -> list[ConfigProblem]:
    """Any `evaluation.*` setting needs held-out prompts (`data.eval_path`, or
    `data.reasoning_gym.eval_size` with `data.source: reasoning_gym`)."""
    if cfg.data.has_held_out:
        return []
    out = []
    for name in ("freq_steps", "max_prompts", "max_new_tokens"):
        value = getattr(cfg.evaluation, name)
        if value is not None:
            out.append(ConfigProblem(
                f"evaluation.{name}", "is set but data.eval_path is not: set data.eval_path "
                f"to a JSONL file of held-out prompts, or remove evaluation.{name}", value,
            ))
    return out


def _check_warmup(cfg: ArealiteConfig) -> list[ConfigProblem]:
    """`actor.optimizer.warmup_steps` <= `actor.optimizer.total_steps` when the latter is set."""
    opt = cfg.actor.optimizer
    if opt.total_steps is not None and opt.warmup_steps > opt.total_steps:
        return [ConfigProblem(
            "actor.optimizer.warmup_steps",
            f"must be <= actor.optimizer.total_steps = {opt.total_steps}", opt.warmup_steps,
        )]
    return []


def _check_context_length(cfg: ArealiteConfig) -> list[ConfigProblem]:
    """Prompt + completion fit the server's context length when one is set
    (`server.context_length`, or `server.sglang.context_length` with SGLang)."""
    if cfg.launch.server_backend == "sglang":
        ctx, ctx_name = cfg.server.sglang.context_length, "server.sglang.context_length"
    else:
        ctx, ctx_name = cfg.server.context_length, "server.context_length"
    if ctx is None:
        return []
    out = []
    prompt = cfg.data.max_prompt_len or 1
    budgets = [("generation.max_new_tokens", cfg.generation.max_new_tokens)]
    if cfg.evaluation.max_new_tokens is not None:
        budgets.append(("evaluation.max_new_tokens", cfg.evaluation.max_new_tokens))
    for name, new_tokens in budgets:
        if prompt + new_tokens > ctx:
            what = f"data.max_prompt_len ({prompt}) + {name}" if cfg.data.max_prompt_len else name
            out.append(ConfigProblem(
                name, f"{what} must fit in {ctx_name} = {ctx}", new_tokens,
            ))
    return out


def _check_shm_backend(cfg: ArealiteConfig) -> list[ConfigProblem]:
    """`weight_sync.method: shm` needs `launch.server_backend: embedded` (SGLang cannot read the shared-memory
    file); `tensor` needs embedded or sglang servers (the simulator takes no tensor handles)."""
    if cfg.weight_sync.method == "shm" and cfg.launch.server_backend != "embedded":
        return [ConfigProblem(
            "weight_sync.method", f"= shm works only with the embedded server on the trainer's host, not "
            f"launch.server_backend = {cfg.launch.server_backend}: use weight_sync.method=distributed "
            "(or disk)", "shm",
        )]
    if cfg.weight_sync.method == "tensor" and cfg.launch.server_backend not in ("embedded", "sglang"):
        return [ConfigProblem(
            "weight_sync.method", f"= tensor needs servers that take tensor handles (launch.server_backend = "
            f"embedded or sglang), not {cfg.launch.server_backend}: use weight_sync.method=distributed (or disk)",
            "tensor",
        )]
    return []


def _check_merged_export(cfg: ArealiteConfig) -> list[ConfigProblem]:
    """`saver.export_merged_at_end` needs `actor.lora` (full fine-tuning's export is already the whole model)."""
    if cfg.saver.export_merged_at_end and cfg.actor.lora is None:
        return [ConfigProblem(
            "saver.export_merged_at_end", "merges LoRA adapters into the base, but actor.lora is null: set "
            "actor.lora, or leave it false (saver.export_hf_at_end already exports the whole model)", True,
        )]
    return []


def _check_fp8(cfg: ArealiteConfig) -> list[ConfigProblem]:
    """`server.quantization: fp8` needs full-weight pushes (not `actor.lora`), and on SGLang a
    `server.model_path` holding a block-FP8 checkpoint (docs/precision.md)."""
    if cfg.server.quantization != "fp8":
        return []
    out = []
    if cfg.actor.lora is not None:
        out.append(ConfigProblem(
            "server.quantization", "= fp8 cannot serve LoRA adapters: a LoRA push sends only the adapters, "
            "which the servers add to a base they would have to re-quantise; set server.quantization=null "
            "or actor.lora=null", "fp8"))
    if cfg.launch.server_backend == "sglang" and not cfg.server.model_path:
        out.append(ConfigProblem(
            "server.model_path", "is empty with server.quantization = fp8 on SGLang: SGLang keeps 128x128 "
            "block scales only for a checkpoint whose config.json carries quantization_config {quant_method: "
            "fp8, weight_block_size: [128, 128]} (a bf16 checkpoint is quantised per channel and the "
            "trainer's block pushes would not fit); write one with `python -m arealite.quant.fp8_checkpoint "
            "SRC DST` and set server.model_path=DST", None))
    return out


def config_advice(cfg: ArealiteConfig) -> list[str]:
    """Settings that run but are likely not what is wanted (the trainer logs them as warnings)."""
    out = []
    if cfg.server.quantization == "fp8" and cfg.algorithm.mismatch.mode == "none":
        out.append("server.quantization = fp8 with algorithm.mismatch.mode = none: the servers sample from "
                   "FP8-rounded weights while the trainer scores in its own precision; set "
                   "algorithm.mismatch.mode=tis (and algorithm.use_decoupled_loss=true) to correct the gap "
                   "(docs/precision.md)")
    return out


#: Checks that relate several fields; each docstring is listed in docs/config_reference.md.
CROSS_FIELD_CHECKS = (
    _check_batch_divisible,
    _check_rloo_group,
    _check_eval_needs_data,
    _check_warmup,
    _check_context_length,
    _check_shm_backend,
    _check_merged_export,
    _check_fp8,
    check_algorithm,
    check_placement,
)


def config_problems(cfg: ArealiteConfig, *, check_paths: bool = True,
                    extra_checks: Sequence[ConfigCheck] = ()) -> list[ConfigProblem]:
    """Every cross-field problem of a validated config, those of `extra_checks`, and path
    problems with `check_paths`."""
    out: list[ConfigProblem] = []
    for check in (*CROSS_FIELD_CHECKS, *extra_checks):
        out += check(cfg)
    if check_paths:
        out += path_problems({d: getattr(getattr(cfg, d.split(".")[0]), d.split(".")[1]) for d in PATH_FIELDS})
    return out


def check_config(cfg: ArealiteConfig, *, check_paths: bool = True,
                 extra_checks: Sequence[ConfigCheck] = ()) -> ArealiteConfig:
    """Raise `ConfigError` if the config breaks a cross-field rule, an `extra_checks` one
    (or a path check); else return it."""
    problems = config_problems(cfg, check_paths=check_paths, extra_checks=extra_checks)
    if problems:
        raise ConfigError(problems)
    return cfg
