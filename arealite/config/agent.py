"""Config of agentic RL: the OpenAI-compatible endpoint, the code sandbox and the LLM judge."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from arealite.config.section import Section

#: OpenAI sampling parameters a request may be allowed to set (`agent.request_sampling`).
REQUEST_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "max_tokens")


class SandboxConfig(Section):
    cpu_s: float = Field(10.0, gt=0)
    """CPU seconds one sandboxed run may use (RLIMIT_CPU; then SIGXCPU)."""
    wall_s: float = Field(20.0, gt=0)
    """Wall-clock seconds before the run and every process it started are killed."""
    memory_mb: int = Field(1024, ge=64)
    """Address-space limit of each process of the run (RLIMIT_AS), in MiB."""
    file_size_mb: int = Field(16, ge=1)
    """Largest file the run may write (RLIMIT_FSIZE), in MiB."""
    max_processes: int = Field(32, ge=1)
    """Most processes (and threads) the run may have at once (RLIMIT_NPROC, counted under the
    run's own user id when the trainer runs as root)."""
    max_output_bytes: int = Field(65536, ge=1)
    """Bytes of stdout and of stderr kept; the rest is read and dropped."""
    network: bool = False
    """Allow network access (otherwise the run gets a network namespace of its own, where the
    kernel allows it)."""

    @model_validator(mode="after")
    def _cpu_within_wall(self) -> "SandboxConfig":
        if self.cpu_s > self.wall_s:
            raise ValueError(f"cpu_s={self.cpu_s} exceeds wall_s={self.wall_s}: the wall clock would "
                             "always end the run first; lower cpu_s or raise wall_s")
        return self


class JudgeConfig(Section):
    addrs: list[str] = Field(default_factory=list)
    """`host:port` of the inference servers (SGLang or embedded, started for the judge model)
    that grade answers; empty: those in the `AREALITE_JUDGE_ADDRS` environment variable."""
    model_path: str | None = None
    """The judge model's directory; its tokenizer (chat template) renders the rubric prompt."""
    tokenizer_path: str | None = None
    """Tokenizer of the judge (None = `model_path`)."""
    rubric: str = (
        "Grade the answer to the question against the reference answer.\n"
        "Question: {question}\nReference: {reference}\nAnswer: {answer}\n"
        "Reply with 'Score: N' where N is an integer from 0 to {max_score}."
    )
    """Prompt sent to the judge (as a user turn of its chat template); `{question}`,
    `{answer}`, `{reference}` and `{max_score}` are filled in."""
    max_score: int = Field(10, ge=1)
    """The rubric's top score; the reward is score / max_score, in [0, 1]."""
    score_pattern: str = r"[Ss]core\s*[:=]\s*(-?\d+(?:\.\d+)?)"
    """Regular expression whose first group is the score in the judge's reply (the last match wins)."""
    max_new_tokens: int = Field(64, ge=1)
    """Tokens the judge may write."""
    temperature: float = Field(0.0, ge=0)
    """Judge sampling temperature (0 = greedy)."""
    timeout_s: float = Field(60.0, gt=0)
    """Timeout of one judge request; a server that fails is retried on the next one."""
    api_key: str | None = Field(None, min_length=1)
    """Bearer key of the judge servers, if they need one; never logged."""
    n_servers: int = Field(0, ge=0)
    """Judge servers the local launcher starts (arealite's embedded server on `model_path`,
    logs `judge0.log`, ...) and hands to the trainer in `AREALITE_JUDGE_ADDRS`; 0 = none
    (use `addrs`, or servers you started)."""

    @model_validator(mode="after")
    def _launched_judges(self) -> "JudgeConfig":
        if self.n_servers and not self.model_path:
            raise ValueError(f"agent.judge.n_servers={self.n_servers} needs agent.judge.model_path (the "
                             "judge model the launcher serves)")
        if self.n_servers and self.addrs:
            raise ValueError(f"agent.judge.n_servers={self.n_servers} starts the judge servers, but "
                             "agent.judge.addrs names some too: set one of the two")
        return self

    @field_validator("addrs")
    @classmethod
    def _host_port(cls, v: list[str]) -> list[str]:
        for addr in v:
            host, sep, port = addr.removeprefix("http://").rpartition(":")
            if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ValueError(f"{addr!r} is not `host:port` with a port in 1..65535 (e.g. 127.0.0.1:30001)")
        return v

    @field_validator("score_pattern")
    @classmethod
    def _one_group(cls, v: str) -> str:
        try:
            groups = re.compile(v).groups
        except re.error as e:
            raise ValueError(f"is not a regular expression: {e}") from None
        if groups < 1:
            raise ValueError("needs a capturing group around the number, e.g. 'Score: (\\d+)'")
        return v

    @field_validator("rubric")
    @classmethod
    def _has_answer(cls, v: str) -> str:
        if "{answer}" not in v:
            raise ValueError("must contain '{answer}' (where the graded answer goes)")
        return v


class AgentConfig(Section):
    host: str = Field("127.0.0.1", min_length=1)
    """Interface the OpenAI-compatible endpoint binds to (on each rollout process). Keep
    127.0.0.1 unless agents run on other hosts."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the endpoint (0 = a free port). A fixed port serves the training workflow; the
    evaluation copy, which has an endpoint of its own, then takes a free one."""
    served_model_name: str = Field("arealite-policy", min_length=1)
    """Model name `/v1/models` lists; requests may name any model."""
    tool_parser: str = Field("hermes", min_length=1)
    """How tool calls are read from the model's text: `hermes` (Qwen/Hermes
    `<tool_call>{json}</tool_call>`) or `module:Class` of your own."""
    request_sampling: list[Literal["temperature", "top_p", "top_k", "min_p", "max_tokens"]] = Field(
        default_factory=lambda: ["max_tokens"])
    """Sampling parameters a request may set; for the others the `generation` section's value is
    used (and a request setting a different one is counted in `agent_sampling_overridden`).
    Letting requests set `temperature` makes the behaviour log-probs differ from the trainer's
    unless they equal `generation.temperature`."""
    max_tokens: int | None = Field(None, ge=1)
    """Most tokens one completion may have; a request asking more is clamped (None =
    `generation.max_new_tokens`, also the default when a request sets none)."""
    max_n: int = Field(8, ge=1)
    """Largest `n` (choices per request) a request may ask."""
    allow_remote_images: bool = False
    """Chat ``image_url`` parts may name ``http(s)://`` URLs, fetched by the endpoint (false:
    only ``data:`` URLs; a remote URL is a 400)."""
    max_image_bytes: int = Field(8 << 20, ge=1)
    """Largest encoded image (bytes) one ``image_url`` part may carry or fetch."""
    max_calls_per_episode: int = Field(64, ge=1)
    """LLM calls one episode may make; the next one is refused (HTTP 400, code `calls_exhausted`)."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """Limits of sandboxed code runs (`arealite.sandbox`, the code reward and tool)."""
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    """The LLM judge of `arealite.reward.judge:judge_reward`."""
