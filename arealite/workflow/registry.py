"""Workflows named in config: ``rollout.workflow`` is a built-in short name or ``module:Class``.

A built-in is a `RolloutWorkflow` subclass under ``arealite/workflow/`` decorated with
``@builtin_workflow("name")``: that one line is all it takes to make it nameable, and the
list of allowed names is read from the decorated classes themselves. The workflows built
on this room (the agent's, the environments') are built-ins named by import string in
`BUILTIN_SPECS`, as a user's own workflow is, so this room imports none of them.

How a workflow is built from config (`build_workflow`):

- a class with a ``from_config(cfg, tokenizer, **workflow_kwargs)`` classmethod is built
  by it;
- any other class gets, by parameter name, whichever of the run's pieces its constructor
  asks for (`INJECTED`: ``config``, ``tokenizer``, ``generation``, ``rollout``, ``data``,
  ``reward_fn``), plus ``rollout.workflow_kwargs``.

The evaluation copy is built the same way from a config whose ``generation`` samples
greedily, once per prompt (`eval_config`).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Callable, TypeVar

from arealite.config.problems import ConfigProblem
from arealite.utils.imports import import_callable, is_import_spec, register_into
from arealite.utils.json_types import JsonObject, JsonValue

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from arealite.config.schema import ArealiteConfig
    from arealite.workflow.base import RolloutWorkflow

#: Constructor parameters filled from the run itself, not from ``rollout.workflow_kwargs``.
INJECTED = ("config", "tokenizer", "generation", "rollout", "data", "reward_fn")

_BUILTIN: dict[str, type] = {}
_T = TypeVar("_T", bound=type)

#: Built-in workflows of the rooms above this one, by short name: their ``module:Class``.
BUILTIN_SPECS = {
    "agent": "arealite.agent.workflow:AgentWorkflow",
    "verifiers": "arealite.environments.verifiers_env:VerifiersWorkflow",
    "openenv": "arealite.environments.openenv_env:OpenEnvWorkflow",
}
#: Modules that held built-in workflows once, and those workflows' short names (an old
#: ``module:Class`` fails naming where its class lives now).
MOVED = {"arealite.workflow.agent": ("agent",), "arealite.workflow.environments": ("verifiers", "openenv")}


def builtin_workflow(name: str) -> Callable[[_T], _T]:
    """Class decorator: make a workflow nameable in config as ``rollout.workflow: <name>``."""
    return register_into(_BUILTIN, name, "workflow")


def builtin_workflows() -> dict[str, type]:
    """Every built-in workflow by short name (imports the modules of this package once, and
    those `BUILTIN_SPECS` names)."""
    import arealite.workflow as package

    for mod in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{mod.name}")
    elsewhere = {name: import_callable(spec, f"built-in workflow {name!r}") for name, spec in BUILTIN_SPECS.items()}
    return {**_BUILTIN, **elsewhere}


def resolve_workflow_class(spec: str) -> type:
    """The workflow class `spec` names; raises ValueError saying what is allowed."""
    builtins = builtin_workflows()
    if spec in builtins:
        return builtins[spec]
    if not is_import_spec(spec):
        raise ValueError(f"is neither a built-in workflow ({', '.join(sorted(builtins))}) nor "
                         "'module:Class' of your own RolloutWorkflow")
    module = spec.partition(":")[0]
    if module in MOVED:
        now = " or ".join(f"{name!r} ({BUILTIN_SPECS[name]})" for name in MOVED[module])
        raise ValueError(f"names module {module}, which no longer exists: write {now}")
    try:
        cls = import_callable(spec, "workflow")
    except (ImportError, AttributeError, TypeError) as e:
        raise ValueError(str(e)) from None
    if not (inspect.isclass(cls) and callable(getattr(cls, "arun_episode", None))):
        raise ValueError(f"{spec!r} is not a class with an `async arun_episode(client, item)` method "
                         "(subclass arealite.workflow.base.RolloutWorkflow)")
    return cls


def _signature(cls: type) -> tuple[inspect.Signature, set[str]]:
    """The signature users' kwargs are checked against, and the parameters filled by us."""
    factory = getattr(cls, "from_config", None)
    if factory is not None:
        params = list(inspect.signature(factory).parameters.values())[2:]  # cfg, tokenizer
        return inspect.Signature(params), set()
    return inspect.signature(cls), set(INJECTED)


def workflow_kwargs_problems(cls: type, kwargs: Mapping[str, JsonValue]) -> list[tuple[str, str]]:
    """(key, reason) for every ``rollout.workflow_kwargs`` entry the class cannot take,
    and for every required parameter nobody provides."""
    sig, injected = _signature(cls)
    params = sig.parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    allowed = sorted(named - injected)
    out = []
    for key in kwargs:
        if key in injected and key in named:
            out.append((key, f"is filled by arealite itself for {cls.__name__}; remove it"))
        elif key not in named and not takes_any:
            out.append((key, f"is not a parameter of {cls.__name__} (it takes: {', '.join(allowed) or 'none'})"))
    for name, p in params.items():
        required = p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        if required and name not in injected and name not in kwargs:
            out.append((name, f"is a required parameter of {cls.__name__}: set rollout.workflow_kwargs.{name}"))
    return out


def workflow_problems(cfg: ArealiteConfig) -> list[ConfigProblem]:
    """`rollout.workflow` names a built-in or importable workflow class, and
    `rollout.workflow_kwargs` fits its constructor (a config check, run before anything starts)."""
    try:
        cls = resolve_workflow_class(cfg.rollout.workflow)
    except ValueError as e:
        return [ConfigProblem("rollout.workflow", str(e), cfg.rollout.workflow)]
    if cfg.data.source == "environment" and getattr(cls, "prompt_sets", None) is None:
        return [ConfigProblem("data.source", f"is environment, but rollout.workflow {cfg.rollout.workflow!r} has "
                              "no environment datasets (`verifiers` and `openenv` do): set data.source: files "
                              "and data.train_path", cfg.data.source)]
    return [ConfigProblem(f"rollout.workflow_kwargs.{key}", why, cfg.rollout.workflow_kwargs.get(key))
            for key, why in workflow_kwargs_problems(cls, cfg.rollout.workflow_kwargs)]


def environment_prompt_sets(cfg: ArealiteConfig) -> tuple[Sequence[JsonObject], Sequence[JsonObject]]:
    """The datasets of the workflow's environment (`data.source: environment`): its class's
    ``prompt_sets(cfg)`` (training items, held-out items)."""
    cls = resolve_workflow_class(cfg.rollout.workflow)
    sets = getattr(cls, "prompt_sets", None)
    if sets is None:
        raise ValueError(f"data.source is environment but rollout.workflow {cfg.rollout.workflow!r} has no "
                         "environment datasets (a `prompt_sets(cfg)` classmethod, as `verifiers` and `openenv` "
                         "have): set data.source: files and data.train_path")
    return sets(cfg)


def eval_config(cfg: ArealiteConfig, sampled: bool = False) -> ArealiteConfig:
    """`cfg` with evaluation's generation: greedy and one sample per prompt, or (``sampled``)
    `evaluation.n_samples` answers at `evaluation.temperature` (for pass@k)."""
    ev = cfg.evaluation
    update: dict[str, int | float | bool] = {"n_samples": 1, "greedy": True}
    if sampled:
        update = {"n_samples": ev.n_samples, "greedy": False, "temperature": ev.temperature}
    update["max_new_tokens"] = ev.max_new_tokens or cfg.generation.max_new_tokens
    return cfg.model_copy(update={"generation": cfg.generation.model_copy(update=update)})


def samples_at_eval(cfg: ArealiteConfig, workflow: RolloutWorkflow | None = None) -> bool:
    """Whether the run evaluates sampled answers too: `evaluation.n_samples` > 1 and the
    workflows are built from config (a workflow object given in code is evaluated as is)."""
    return cfg.evaluation.n_samples > 1 and workflow is None


def build_workflow(cfg: ArealiteConfig, tokenizer: PreTrainedTokenizerBase, *,
                   evaluation: bool | str = False) -> RolloutWorkflow:
    """Build ``rollout.workflow`` with ``rollout.workflow_kwargs``; ``evaluation`` True gives the
    greedy evaluation copy, ``"sampled"`` the pass@k copy (`eval_config`)."""
    from arealite.reward import configure, load_reward_fn

    configure(cfg)  # sandbox limits and judge of the library's rewards
    cls = resolve_workflow_class(cfg.rollout.workflow)
    kwargs = dict(cfg.rollout.workflow_kwargs)
    problems = workflow_kwargs_problems(cls, kwargs)
    if problems:
        raise ValueError("; ".join(f"rollout.workflow_kwargs.{k} {why}" for k, why in problems))
    run_cfg = eval_config(cfg, sampled=evaluation == "sampled") if evaluation else cfg
    if getattr(cls, "from_config", None) is not None:
        return cls.from_config(run_cfg, tokenizer, **kwargs)
    pieces = {"config": run_cfg, "tokenizer": tokenizer, "generation": run_cfg.generation,
              "rollout": run_cfg.rollout, "data": run_cfg.data}
    params = inspect.signature(cls).parameters
    if "reward_fn" in params:
        pieces["reward_fn"] = load_reward_fn(cfg.data.reward_fn)
    return cls(**{k: v for k, v in pieces.items() if k in params}, **kwargs)
