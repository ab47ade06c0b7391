"""AgentWorkflow: train an agent written against the OpenAI API, unchanged.

The user writes one coroutine function::

    async def run(client: openai.AsyncOpenAI, item: dict) -> float | dict:
        resp = await client.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...                      # call tools, call the model again, any agent framework
        return reward            # or {"reward": r, "call_rewards": {resp.id: 0.5}}

and names it in config (``rollout.workflow: agent``, ``rollout.workflow_kwargs: {run:
mypkg.agent:run}``). For every dataset item the workflow runs ``generation.n_samples``
episodes at once; each gets a client of its own session of the OpenAI-compatible
endpoint (`arealite.agent.endpoint`), served on the controller's event loop, so the
agent's calls go through the inference client like any workflow's. When the agent
returns, the session's calls become rows (`arealite.agent.trajectory`), one group per
item; with MoE routing replay (``algorithm.routing_replay: r3``) they carry the servers'
routing (``routed_experts``) as the other workflows' rows do.

An agent that raises, or does not return within ``timeout_s``, fails the item: the
controller's ``rollout.on_workflow_error`` decides (``fail`` stops the run, ``drop``
skips the item); its other episodes are cancelled, with their calls in flight.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from typing import TYPE_CHECKING, Awaitable, Callable

import torch
from tensordict import TensorDict

from arealite.agent.trajectory import call_returns, episode_rows, with_routed_experts
from arealite.api.contracts import InferenceClient
from arealite.config.agent import AgentConfig
from arealite.config.schema import GenerationConfig
from arealite.utils.imports import import_callable
from arealite.utils.json_types import JsonObject
from arealite.workflow.base import RolloutWorkflow, new_group_id, pad_and_stack

if TYPE_CHECKING:
    import httpx
    from openai import AsyncOpenAI
    from transformers import PreTrainedTokenizerBase

    from arealite.agent.endpoint import AgentEndpoint
    from arealite.agent.session import LLMCall, Session
    from arealite.config.schema import ArealiteConfig

__all__ = ["AgentError", "AgentWorkflow"]

#: ``async def run(client: openai.AsyncOpenAI, item: dict) -> float | dict``
AgentFn = Callable[["AsyncOpenAI", JsonObject], Awaitable[object]]
#: What one episode left: its calls, the episode reward and the per-call rewards by response id.
Episode = tuple[list["LLMCall"], float, dict[str, float]]
_ROWS = ("conversation", "call")


class AgentError(RuntimeError):
    """The user's agent raised, returned something that is not a reward, or timed out."""


def parse_result(out: object) -> tuple[float, dict[str, float]]:
    """The agent's return value as (episode reward, per-call rewards by response id)."""
    if isinstance(out, (bool, int, float)):
        reward, calls = float(out), {}
    elif isinstance(out, dict) and set(out) <= {"reward", "call_rewards"} and out:
        reward = out.get("reward", 0.0)
        calls = out.get("call_rewards") or {}
        if not isinstance(reward, (bool, int, float)) or not isinstance(calls, dict) or not all(
                isinstance(k, str) and isinstance(v, (bool, int, float)) for k, v in calls.items()):
            raise AgentError(f"the agent returned {out!r:.200}: 'reward' must be a number and 'call_rewards' "
                             "a {response id: number} dict")
        reward, calls = float(reward), {k: float(v) for k, v in calls.items()}
    else:
        raise AgentError(f"the agent returned {out!r:.200}; return a number (the reward) or "
                         "{'reward': float, 'call_rewards': {response id: float}}")
    if not all(map(math.isfinite, [reward, *calls.values()])):
        raise AgentError(f"the agent returned a reward that is NaN or infinite: {out!r:.200}")
    return reward, calls


class AgentWorkflow(RolloutWorkflow):
    """Runs ``run(client, item)`` per sample through the OpenAI-compatible endpoint.

    ``rows``: ``conversation`` (one row per linear conversation) or ``call`` (one per LLM
    call). ``stepwise``: rows of an episode share ``traj_id`` and get one advantage (the
    episode's reward); off, each row is advantaged on its own discounted return
    (``turn_discount``). ``timeout_s``: wall clock of one episode.
    """

    def __init__(self, run: AgentFn | str, *, tokenizer: PreTrainedTokenizerBase, generation: GenerationConfig,
                 agent: AgentConfig | None = None, rows: str = "conversation", stepwise: bool = True,
                 turn_discount: float = 1.0, timeout_s: float = 600.0):
        if isinstance(run, str):
            run = import_callable(run, "rollout.workflow_kwargs.run")
        if not (inspect.iscoroutinefunction(run) or inspect.iscoroutinefunction(getattr(run, "__call__", None))):
            raise TypeError(f"rollout.workflow_kwargs.run must be an `async def run(client, item)`, got {run!r}")
        if rows not in _ROWS:
            raise ValueError(f"rollout.workflow_kwargs.rows={rows!r} must be one of {', '.join(_ROWS)}")
        if not 0 < turn_discount <= 1:
            raise ValueError(f"rollout.workflow_kwargs.turn_discount={turn_discount} must be in (0, 1]")
        if not timeout_s > 0:
            raise ValueError(f"rollout.workflow_kwargs.timeout_s={timeout_s} must be > 0 (seconds)")
        self.run, self.tokenizer, self.generation = run, tokenizer, generation
        self.agent = agent or AgentConfig()
        self.rows, self.stepwise, self.turn_discount, self.timeout_s = rows, stepwise, turn_discount, timeout_s
        self.counters = {"episodes": 0, "agent_errors": 0, "agent_timeouts": 0, "episodes_without_calls": 0}
        self._ep: AgentEndpoint | None = None  # the endpoint on the current event loop
        self._http: httpx.AsyncClient | None = None
        self._starting: asyncio.Task | None = None  # the endpoint's start, while under way

    @classmethod
    def from_config(cls, cfg: ArealiteConfig, tokenizer: PreTrainedTokenizerBase, *, run: str,
                    rows: str = "conversation", stepwise: bool = True, turn_discount: float = 1.0,
                    timeout_s: float = 600.0) -> AgentWorkflow:
        """The run's workflow: ``generation`` and the ``agent`` section from the config, the rest
        from ``rollout.workflow_kwargs``."""
        return cls(run, tokenizer=tokenizer, generation=cfg.generation, agent=cfg.agent, rows=rows,
                   stepwise=stepwise, turn_discount=turn_discount, timeout_s=timeout_s)

    def __getstate__(self) -> dict[str, object]:  # the endpoint belongs to one process's loop
        return {**self.__dict__, "_ep": None, "_http": None, "_starting": None}

    def stats(self) -> dict[str, int]:
        out = dict(self.counters)
        if self._ep is not None:
            out.update({f"agent_{k}": v for k, v in self._ep.stats().items()})
        return out

    # ------------------------------------------------------------ the endpoint
    async def endpoint(self) -> AgentEndpoint:
        """The endpoint on the running loop, started on first use (and again on a new loop).

        Episodes of a batch ask for it at once: the first starts it and the others wait for
        that start (one endpoint per loop, not one per episode that found none)."""
        loop = asyncio.get_running_loop()
        ep = self._ep
        if ep is not None and ep.loop is loop and ep.running:
            return ep
        if self._starting is None or self._starting.get_loop() is not loop:
            self._starting = loop.create_task(self._start_endpoint())
        starting = self._starting
        try:
            return await asyncio.shield(starting)  # one waiter cancelled does not cancel the start
        finally:
            if starting.done() and self._starting is starting:
                self._starting = None  # a failed start is tried again by the next episode

    async def _start_endpoint(self) -> AgentEndpoint:
        import openai

        from arealite.agent.endpoint import AgentEndpoint

        ep = AgentEndpoint(self.tokenizer, self.generation, self.agent)
        await ep.start()
        http = openai.DefaultAsyncHttpxClient()
        ep.on_close(http.aclose)
        self._ep, self._http = ep, http
        return ep

    def _client(self, ep: AgentEndpoint, session: Session) -> AsyncOpenAI:
        import openai

        # No retries: a retried call would be generated (and recorded) twice.
        return openai.AsyncOpenAI(base_url=ep.base_url(session), api_key=session.key, max_retries=0,
                                  timeout=self.timeout_s, http_client=self._http)

    # ------------------------------------------------------------ episodes
    async def _episode(self, ep: AgentEndpoint, client: InferenceClient, item: JsonObject, gid: int) -> Episode:
        session = ep.open_session(client, f"agent-g{gid}")
        self.counters["episodes"] += 1
        name = getattr(self.run, "__qualname__", repr(self.run))
        try:
            out = await asyncio.wait_for(self.run(self._client(ep, session), item), self.timeout_s)
        except asyncio.TimeoutError:
            self.counters["agent_timeouts"] += 1
            raise AgentError(f"agent {name} did not return within timeout_s={self.timeout_s:g}s "
                             f"on item {item.get('prompt_id', '?')}") from None
        except (asyncio.CancelledError, AgentError):
            raise
        except Exception as e:
            self.counters["agent_errors"] += 1
            raise AgentError(f"agent {name} raised on item {item.get('prompt_id', '?')}: {e!r}") from e
        finally:
            ep.close_session(session)
        try:
            reward, call_rewards = parse_result(out)
        except AgentError:
            self.counters["agent_errors"] += 1
            raise
        unknown = set(call_rewards) - {c.id for c in session.calls}
        if unknown:
            self.counters["agent_errors"] += 1
            raise AgentError(f"call_rewards names response ids this episode never got: {sorted(unknown)}")
        for call in session.calls:
            call.reward = call_rewards.get(call.id)
        return session.calls, reward, call_rewards

    async def arun_episode(self, client: InferenceClient, item: JsonObject) -> TensorDict | None:
        ep = await self.endpoint()
        gid = new_group_id()
        tasks = [asyncio.ensure_future(self._episode(ep, client, item, gid)) for _ in range(self.generation.n_samples)]
        try:
            episodes = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return self._group(episodes, gid, item)

    def _group(self, episodes: list[Episode], gid: int, item: JsonObject) -> TensorDict | None:
        rows, per_row = [], {"rewards": [], "traj_id": [], "step_id": [], "truncated": [], "n_calls": []}
        paths: list[list[LLMCall]] = []  # the calls behind each row (MoE routing)
        for calls, reward, call_rewards in episodes:
            if not calls:
                self.counters["episodes_without_calls"] += 1
                continue
            traj = new_group_id()
            total = reward + sum(c.reward or 0.0 for c in calls)
            returns = None if self.stepwise else call_returns(calls, reward, self.turn_discount)
            for step, (row, first, path) in enumerate(episode_rows(calls, self.rows)):
                rows.append(row)
                paths.append(path)
                per_row["rewards"].append(total if returns is None else returns[first])
                per_row["traj_id"].append(traj)
                per_row["step_id"].append(step)
                per_row["truncated"].append(path[-1].finish_reason == "length")
                per_row["n_calls"].append(len(calls))
        if not rows:
            return None
        n = len(rows)
        tensors = {
            "rewards": torch.tensor(per_row["rewards"], dtype=torch.float32),
            "group_id": torch.full((n,), gid, dtype=torch.int64),
            "prompt_id": torch.full((n,), int(item.get("prompt_id", -1)), dtype=torch.int64),
            "truncated": torch.tensor(per_row["truncated"], dtype=torch.bool),
            "n_calls": torch.tensor(per_row["n_calls"], dtype=torch.int64),
        }
        if self.stepwise:
            tensors["traj_id"] = torch.tensor(per_row["traj_id"], dtype=torch.int64)
            tensors["step_id"] = torch.tensor(per_row["step_id"], dtype=torch.int64)
        return with_routed_experts(pad_and_stack(rows, tensors), paths)  # MoE routing replay (R3)
