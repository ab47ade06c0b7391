"""The rollout side: the controller, its queues and workflows (`rollout`), and the sampling
of training rollouts (`generation`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from arealite.config.section import Section


class RolloutConfig(Section):
    workflow: str = Field("rlvr", min_length=1)
    """The `RolloutWorkflow` that turns one dataset item into trajectories: a built-in name
    (`rlvr`, `multi_turn`; see `arealite.workflow.registry`) or `module:Class` of your own.
    Its constructor gets, by parameter name, any of `config`, `tokenizer`, `generation`,
    `rollout`, `data`, `reward_fn`, plus `workflow_kwargs` (or a `from_config` classmethod)."""
    workflow_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the workflow's constructor, checked against its signature
    before anything starts."""
    worker: Literal["process", "thread"] = "process"
    """Where each trainer rank's rollout runs (client, controller, workflows, rewards):
    `process`, a child process with its own GIL, so that handling responses never slows
    the training step that runs meanwhile (on the servers' cores when `launch.server_cpus`
    pins them); `thread`, a thread of the trainer process (a workflow object passed to
    `RLTrainer` that cannot be pickled needs it)."""
    max_concurrent_rollouts: int = Field(64, ge=1)
    """Most episodes (workflow calls) in flight at once, per trainer rank."""
    queue_size: int = Field(1024, ge=1)
    """Capacity of the input and output queues; a full queue back-pressures admission."""
    consumer_batch_size: int = Field(8, ge=1)
    """Trajectory groups (prompts) per training step, over all trainer ranks."""
    max_head_offpolicyness: int = Field(2, ge=0)
    """Staleness bound eta in policy versions; 0 = synchronous RL."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Timeout of one HTTP generation request before it is retried elsewhere."""
    request_retries: int = Field(3, ge=0)
    """Retries of a failed request (on another healthy server) before the error is raised."""
    retry_backoff_s: float = Field(0.5, ge=0)
    """First backoff between retries; doubles on each retry."""
    max_inflight_per_server: int = Field(256, ge=1)
    """Most requests in flight on one server; fewer where the server reports
    ``max_running_requests`` in its ``/server_info`` (twice that: a batch running, one
    waiting), since a weight update aborts every request queued there."""
    batch_requests: bool = True
    """Send the requests of one affinity key that leave together (a group's samples) to their
    server as one batched `/generate` (SGLang's batch form): one HTTP exchange instead of
    one each. Each request keeps its own retries and resubmission after an abort."""
    max_response_bytes: int = Field(64 << 20, ge=4096)
    """Largest answer (body bytes) the client reads from a server; a bigger one is refused as
    malformed (from its Content-Length, or as it arrives) and the request retried elsewhere."""
    on_workflow_error: Literal["fail", "drop"] = "fail"
    """What a raising workflow does to the run: `fail` stops it, `drop` logs, counts and goes on."""
    reward_timeout_s: float = Field(15.0, gt=0)
    """Timeout of one reward-function call."""
    on_reward_error: Literal["zero", "reject"] = "zero"
    """A reward function that raises, hangs or returns a non-number: reward 0 or reject the group."""
    reward_workers: int = Field(2, ge=1)
    """Threads running reward functions off the event loop."""
    dump_dir: str | None = None
    """If set, dump generated texts per policy version as JSONL here, for inspection."""
    filter_equal_rewards: bool = False
    """Dynamic sampling: reject groups whose rewards are all equal (no GRPO signal)."""
    gil_switch_interval_ms: float | None = Field(0.5, gt=0)
    """`sys.setswitchinterval` of the process while the controller runs. The rollout loop
    thread and the training thread share the GIL: a thread that wants it back (the trainer
    between two torch ops) waits until the other blocks or this interval ends. Python's
    default, 5 ms, lets bursts of response handling stall training; `null` keeps it."""
    freeze_gc: bool = True
    """At start, move every object alive so far (model, modules, imports) out of the cyclic
    garbage collector's reach (`gc.freeze()`), in the rollout side's process and in every
    trainer rank, so the collections that the rollout's churn and the training steps
    trigger scan only young objects instead of stopping the process for the whole heap
    (~0.2 s each on a CPU host). Cycles among those older objects are then never
    collected; turn off to keep them. (Servers: ``--no-freeze-gc``.)"""
    gc_young_threshold: int | None = Field(50_000, ge=1)
    """The cyclic garbage collector's youngest-generation threshold (`gc.set_threshold`) while
    the controller runs; Python's is 700. The rollout keeps its queued episodes, running
    episodes and waiting groups alive for many collections at 700, and each collection
    traverses them again: ~15 us of the loop thread's CPU per trajectory on
    bench_controller (docs/scale.md, 28 Nov). Garbage cycles live a little longer; `null`
    keeps the threshold."""


class GenerationConfig(Section):
    n_samples: int = Field(4, ge=1)
    """Samples per prompt (the GRPO group size)."""
    max_new_tokens: int = Field(256, gt=0)
    """Most tokens generated per sample."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature; 0 is greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    top_k: int = Field(-1, ge=-1)
    """Top-k sampling (-1 = all tokens)."""
    min_p: float = Field(0.0, ge=0, le=1)
    """Min-p sampling threshold (0 = off)."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Extra token ids that end a sample (the EOS token always does)."""
    greedy: bool = False
    """Decode greedily (argmax), whatever the temperature."""
