"""verifiers environments as a workflow (`rollout.workflow: verifiers`).

Every episode is the environment's own rollout (``env.run_rollout``: its turns, tools,
parser and rubric) against the episode's `AsyncOpenAI` client of the OpenAI-compatible
endpoint, wrapped in verifiers' own OpenAI chat client. The rubric's reward is the
trajectory's reward; with ``turn_rewards`` the rewards the environment gives single turns
(``trajectory[i].reward``) are the calls' rewards instead. The environment's dataset
feeds the controller (``data.source: environment``, `prompt_sets`), so the dataloader,
its checkpointed position and the per-prompt accounting cover it.

verifiers' classic ``Environment`` API (SingleTurnEnv, MultiTurnEnv, ToolEnv, and the
environments of its hub, each a package with ``load_environment(**args)``) is the one
served; verifiers 0.4 dropped it, hence ``verifiers>=0.3.1,<0.4`` in ``arealite[envs]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from arealite.config.agent import AgentConfig
from arealite.config.schema import GenerationConfig, RolloutConfig
from arealite.environments.episode import EnvironmentWorkflow
from arealite.utils.imports import import_callable, is_import_spec
from arealite.utils.json_types import JsonObject, JsonValue

if TYPE_CHECKING:
    from openai import AsyncOpenAI
    from transformers import PreTrainedTokenizerBase

    from arealite.config.schema import ArealiteConfig

INSTALL = "pip install 'arealite[envs]' (verifiers>=0.3.1,<0.4)"
#: Item fields that are arealite's, not the environment's.
_OURS = ("prompt_id",)


class EnvironmentNotFound(ValueError):
    """``rollout.workflow_kwargs.env`` names nothing that can be loaded."""


def load_verifiers_env(env: str, env_args: dict[str, JsonValue] | None = None):  # -> vf.Environment
    """The environment `env` names: ``module:function`` (called with `env_args`) or the id of
    an installed environment package (``verifiers.load_environment(id, **env_args)``)."""
    try:
        import verifiers as vf
        vf.Environment  # noqa: B018  (the classic API, absent from verifiers 0.4)
    except (ImportError, AttributeError) as e:
        raise EnvironmentNotFound(f"rollout.workflow: verifiers needs the verifiers library with its classic "
                                  f"Environment API ({e!r}); {INSTALL}") from None
    args = dict(env_args or {})
    if is_import_spec(env):
        try:
            made = import_callable(env, "rollout.workflow_kwargs.env")(**args)
        except (ImportError, AttributeError, TypeError) as e:
            raise EnvironmentNotFound(f"rollout.workflow_kwargs.env={env!r}: {e}") from None
    else:
        try:
            made = vf.load_environment(env, **args)
        except ValueError as e:  # verifiers' "Could not import ..."
            raise EnvironmentNotFound(
                f"rollout.workflow_kwargs.env={env!r} is not an installed verifiers environment ({e}); install "
                f"its package (`prime env install {env}`, or `pip install` it), or name your own as "
                "'module:function' returning a vf.Environment") from None
    if not isinstance(made, vf.Environment):
        raise EnvironmentNotFound(f"rollout.workflow_kwargs.env={env!r} gave a {type(made).__name__}, "
                                  "not a verifiers Environment")
    return made


def _rows(dataset) -> list[JsonObject]:  # dataset: a datasets.Dataset
    rows = []
    for i, row in enumerate(dataset):
        item = dict(row)
        item["prompt_id"] = i
        rows.append(item)
    return rows


class VerifiersWorkflow(EnvironmentWorkflow):
    """Each episode: ``env.run_rollout`` through the endpoint; reward: the rubric's."""

    def __init__(self, env: str, env_args: dict[str, JsonValue] | None = None, *,
                 tokenizer: PreTrainedTokenizerBase, generation: GenerationConfig,
                 rollout: RolloutConfig | None = None, agent: AgentConfig | None = None,
                 turn_rewards: bool = False, rows: str = "conversation", stepwise: bool = True,
                 timeout_s: float = 600.0):
        self.env = load_verifiers_env(env, env_args)
        self.turn_rewards = turn_rewards
        self.model_name = (agent or AgentConfig()).served_model_name
        super().__init__(self._play, f"verifiers:{env}", tokenizer=tokenizer, generation=generation,
                         rollout=rollout, agent=agent, rows=rows, stepwise=stepwise, timeout_s=timeout_s)

    @classmethod
    def from_config(cls, cfg: ArealiteConfig, tokenizer: PreTrainedTokenizerBase, *, env: str,
                    env_args: dict[str, JsonValue] | None = None, turn_rewards: bool = False,
                    rows: str = "conversation", stepwise: bool = True, timeout_s: float = 600.0) -> VerifiersWorkflow:
        """The run's workflow: `env` and its `env_args` from `rollout.workflow_kwargs`."""
        return cls(env, env_args, tokenizer=tokenizer, generation=cfg.generation, rollout=cfg.rollout,
                   agent=cfg.agent, turn_rewards=turn_rewards, rows=rows, stepwise=stepwise, timeout_s=timeout_s)

    @classmethod
    def prompt_sets(cls, cfg: ArealiteConfig) -> tuple[list[JsonObject], list[JsonObject]]:
        """The environment's training and evaluation datasets as items (``data.source: environment``);
        no evaluation items when the environment has no evaluation dataset."""
        kw = cfg.rollout.workflow_kwargs
        if "env" not in kw:
            raise EnvironmentNotFound("rollout.workflow: verifiers needs rollout.workflow_kwargs.env "
                                      "(an installed environment id, or module:function returning a vf.Environment)")
        env = load_verifiers_env(kw["env"], kw.get("env_args"))
        train = _rows(env.get_dataset())
        env.build_eval_dataset()
        held_out = _rows(env.eval_dataset) if env.eval_dataset is not None else []
        return train, held_out

    async def _play(self, client: AsyncOpenAI, item: JsonObject) -> tuple[float, dict[str, float]]:
        from verifiers.clients import OpenAIChatCompletionsClient

        rollout_input = {k: v for k, v in item.items() if k not in _OURS}
        out = await self.env.run_rollout(rollout_input, OpenAIChatCompletionsClient(client), self.model_name, {},
                                         state_columns=["trajectory"] if self.turn_rewards else None)
        if out.get("error"):
            raise RuntimeError(f"the rollout ended with an error: {out['error']!r:.300}")
        reward = out.get("reward")
        if not self.turn_rewards:
            return reward, {}
        call_rewards = {}
        for step in out.get("trajectory") or []:
            rid = getattr(step.get("response"), "id", None)
            if rid is not None and step.get("reward") is not None:
                call_rewards[rid] = step["reward"]
        return 0.0, call_rewards
