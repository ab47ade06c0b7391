"""OpenEnv environments as a workflow (`rollout.workflow: openenv`).

An episode opens a session on an OpenEnv environment server (its WebSocket protocol,
through openenv's ``GenericEnvClient``), resets it (with the item's ``reset`` fields,
e.g. a seed) and then takes turns: the observation is a user turn, the model's reply
(a chat completion through the endpoint, so the turns are recorded token-exactly and
the observations are masked context) becomes the action ``{action_key: text}``, the
server's step answers with the next observation, a reward and ``done``. The episode's
reward is the sum of the steps' rewards; with ``turn_rewards`` each step's reward is its
call's instead. The server is given by ``url``, or started here from ``env_class``
(``arealite.environments.openenv_server``, a child process on 127.0.0.1 that this
process owns and stops).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from arealite.config.agent import AgentConfig
from arealite.config.schema import GenerationConfig, RolloutConfig
from arealite.environments.episode import EnvironmentWorkflow
from arealite.environments.openenv_server import LocalEnvServer, import_openenv
from arealite.utils.json_types import JsonObject, JsonValue

if TYPE_CHECKING:
    from openai import AsyncOpenAI
    from transformers import PreTrainedTokenizerBase

    from arealite.config.schema import ArealiteConfig


def observation_text(obs: JsonObject, key: str | None) -> str:
    """What the model reads of an observation: its ``key`` field, or (no key) the whole
    observation as JSON, ``metadata`` left out."""
    if key is not None:
        if key not in obs:
            raise KeyError(f"the observation has no field {key!r} (rollout.workflow_kwargs.observation_key); "
                           f"it has: {sorted(obs)}")
        value = obs[key]
        return value if isinstance(value, str) else json.dumps(value)
    return json.dumps({k: v for k, v in obs.items() if k != "metadata"}, sort_keys=True)


class OpenEnvWorkflow(EnvironmentWorkflow):
    """Each episode: reset, then up to ``max_turns`` of (model reply -> step) on one session."""

    def __init__(self, url: str | None = None, *, env_class: str | None = None, action_class: str | None = None,
                 observation_class: str | None = None, action_key: str = "message",
                 observation_key: str | None = None, system_prompt: str | None = None, max_turns: int = 8,
                 turn_rewards: bool = False, tokenizer: PreTrainedTokenizerBase, generation: GenerationConfig,
                 rollout: RolloutConfig | None = None, agent: AgentConfig | None = None, timeout_s: float = 600.0):
        import_openenv()
        if (url is None) == (env_class is None):
            raise ValueError("rollout.workflow: openenv needs rollout.workflow_kwargs.url (a running OpenEnv "
                             "server) or env_class (module:Class, with action_class and observation_class, "
                             "started here as a local server), one of the two")
        if max_turns < 1:
            raise ValueError(f"rollout.workflow_kwargs.max_turns={max_turns} must be >= 1")
        self.server = None if env_class is None else LocalEnvServer(env_class, action_class, observation_class)
        self.url = url
        self.action_key, self.observation_key = action_key, observation_key
        self.system_prompt, self.max_turns, self.turn_rewards = system_prompt, max_turns, turn_rewards
        self.model_name = (agent or AgentConfig()).served_model_name
        self.max_tokens = generation.max_new_tokens
        super().__init__(self._play, f"openenv:{url or env_class}", tokenizer=tokenizer, generation=generation,
                         rollout=rollout, agent=agent, timeout_s=timeout_s)

    @classmethod
    def from_config(cls, cfg: ArealiteConfig, tokenizer: PreTrainedTokenizerBase, *, url: str | None = None,
                    env_class: str | None = None, action_class: str | None = None,
                    observation_class: str | None = None, action_key: str = "message",
                    observation_key: str | None = None, system_prompt: str | None = None, max_turns: int = 8,
                    n_items: int = 256, n_eval_items: int = 0, turn_rewards: bool = False,
                    timeout_s: float = 600.0) -> OpenEnvWorkflow:
        """The run's workflow from `rollout.workflow_kwargs` (`n_items`, `n_eval_items`: see `prompt_sets`)."""
        return cls(url, env_class=env_class, action_class=action_class, observation_class=observation_class,
                   action_key=action_key, observation_key=observation_key, system_prompt=system_prompt,
                   max_turns=max_turns, turn_rewards=turn_rewards, tokenizer=tokenizer, generation=cfg.generation,
                   rollout=cfg.rollout, agent=cfg.agent, timeout_s=timeout_s)

    @classmethod
    def prompt_sets(cls, cfg: ArealiteConfig) -> tuple[list[JsonObject], list[JsonObject]]:
        """``data.source: environment``: an OpenEnv server makes its own tasks at reset, so items are
        episode seeds: `n_items` training items (seeds 0..) and `n_eval_items` held-out ones (other seeds)."""
        kw = cfg.rollout.workflow_kwargs
        n, n_eval = int(kw.get("n_items", 256)), int(kw.get("n_eval_items", 0))
        train = [{"prompt": f"episode {i}", "prompt_id": i, "reset": {"seed": i}} for i in range(n)]
        held_out = [{"prompt": f"episode {n + i}", "prompt_id": i, "reset": {"seed": 1_000_003 + i}}
                    for i in range(n_eval)]
        return train, held_out

    def base_url(self) -> str:
        """The server's URL (the local one is started on first use, in this process)."""
        return self.url if self.server is None else self.server.start()

    async def _play(self, client: AsyncOpenAI, item: JsonObject) -> tuple[float, dict[str, float]]:
        from openenv.core.generic_client import GenericEnvClient

        env = GenericEnvClient(base_url=self.base_url())
        await env.connect()
        try:
            reset: JsonValue = item.get("reset") or {}
            result = await env.reset(**(reset if isinstance(reset, dict) else {}))
            messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
            total, per_call = 0.0, {}
            for _ in range(self.max_turns):
                if result.done:
                    break
                messages.append({"role": "user", "content": observation_text(result.observation, self.observation_key)})
                reply = await client.chat.completions.create(model=self.model_name, messages=messages,
                                                             max_tokens=self.max_tokens)
                text = reply.choices[0].message.content or ""
                messages.append({"role": "assistant", "content": text})
                result = await env.step({self.action_key: text})
                if result.reward is not None:
                    total += result.reward
                    per_call[reply.id] = result.reward
        finally:
            await env.close()
        return (0.0, per_call) if self.turn_rewards else (total, {})
