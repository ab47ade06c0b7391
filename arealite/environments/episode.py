"""What the environment adapters share: an episode is an agent run through the endpoint,
and an environment that fails costs its episode, not the run.

Both adapters (verifiers, OpenEnv) drive their library against the `AsyncOpenAI` client
of the OpenAI-compatible endpoint, so the model's turns are recorded token-exactly and
become trajectories exactly as in `AgentWorkflow`, which `EnvironmentWorkflow` extends.
What differs is the error policy. An agent that raises is the user's bug
(`rollout.on_workflow_error`); an environment that raises, does not finish within
``timeout_s`` or returns a reward that is NaN or infinite is a fact of environments, so
the episode is counted (``env_errors``, ``env_timeouts``, ``env_bad_rewards``) and
handled by `rollout.on_reward_error`: ``reject`` drops the item's group
(``env_rejected_groups``), ``zero`` keeps the episode with reward 0. The run goes on.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
from typing import TYPE_CHECKING, Awaitable, Callable

from tensordict import TensorDict

from arealite.agent.workflow import AgentWorkflow
from arealite.api.contracts import InferenceClient
from arealite.config.agent import AgentConfig
from arealite.config.schema import GenerationConfig, RolloutConfig
from arealite.utils.json_types import JsonObject

if TYPE_CHECKING:
    from openai import AsyncOpenAI
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("arealite.environments")

#: ``play(client, item) -> (episode reward, {response id: reward of that call})``: one episode.
PlayFn = Callable[["AsyncOpenAI", JsonObject], Awaitable[tuple[float, dict[str, float]]]]

# The failures of the item being run: set by EnvironmentWorkflow.arun_episode, seen by its
# episodes (asyncio tasks copy the context they are created in).
_FAILURES: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("arealite_env_failures", default=None)

COUNTERS = ("env_errors", "env_timeouts", "env_bad_rewards", "env_rejected_groups")


class EnvironmentEpisode:
    """The ``run`` an `AgentWorkflow` calls per episode: ``play`` under a timeout, its failures
    counted and reported to the item instead of raised."""

    def __init__(self, play: PlayFn, timeout_s: float, counters: dict[str, int], name: str):
        self.play, self.timeout_s, self.counters, self.name = play, timeout_s, counters, name

    def _failed(self, counter: str, item: JsonObject, why: str) -> float:
        self.counters[counter] += 1
        msg = f"environment {self.name} {why} on item {item.get('prompt_id', '?')}"
        logger.warning("%s", msg)
        failures = _FAILURES.get()
        if failures is not None:
            failures.append(msg)
        return 0.0

    async def __call__(self, client: AsyncOpenAI, item: JsonObject) -> float | dict[str, object]:
        try:
            reward, call_rewards = await asyncio.wait_for(self.play(client, item), self.timeout_s)
        except asyncio.TimeoutError:
            return self._failed("env_timeouts", item, f"did not finish within timeout_s={self.timeout_s:g}s")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the environment's own code: any failure costs the episode only
            return self._failed("env_errors", item, f"raised {e!r:.300}")
        if not all(isinstance(r, (int, float)) and math.isfinite(r) for r in (reward, *call_rewards.values())):
            return self._failed("env_bad_rewards", item, f"returned a reward that is not a finite number: "
                                                         f"{reward!r}, per call {call_rewards!r:.200}")
        return {"reward": float(reward), "call_rewards": {k: float(v) for k, v in call_rewards.items()}}


class EnvironmentWorkflow(AgentWorkflow):
    """An `AgentWorkflow` whose episodes are ``play(client, item)`` of an environment library,
    with the environment error policy above. ``timeout_s``: one episode's wall clock."""

    def __init__(self, play: PlayFn, name: str, *, tokenizer: PreTrainedTokenizerBase, generation: GenerationConfig,
                 rollout: RolloutConfig | None = None, agent: AgentConfig | None = None, rows: str = "conversation",
                 stepwise: bool = True, turn_discount: float = 1.0, timeout_s: float = 600.0):
        if not timeout_s > 0:
            raise ValueError(f"rollout.workflow_kwargs.timeout_s={timeout_s} must be > 0 (seconds)")
        self.env_counters = dict.fromkeys(COUNTERS, 0)
        self.reject_on_error = (rollout or RolloutConfig()).on_reward_error == "reject"
        episode = EnvironmentEpisode(play, timeout_s, self.env_counters, name)
        # The agent's own deadline comes after the environment's, which is the one that should fire.
        super().__init__(episode, tokenizer=tokenizer, generation=generation, agent=agent, rows=rows,
                         stepwise=stepwise, turn_discount=turn_discount, timeout_s=timeout_s + 30.0)

    def stats(self) -> dict[str, int]:
        return {**super().stats(), **self.env_counters}

    async def arun_episode(self, client: InferenceClient, item: JsonObject) -> TensorDict | None:
        failures: list[str] = []
        token = _FAILURES.set(failures)
        try:
            td = await super().arun_episode(client, item)
        finally:
            _FAILURES.reset(token)
        if failures and self.reject_on_error:
            self.env_counters["env_rejected_groups"] += 1
            return None
        return td
