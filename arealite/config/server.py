"""The inference servers: the embedded server's own settings (`server`), SGLang's
(`server.sglang`) and the simulated server's cost model (`server.sim`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from arealite.config.section import Section


class SGLangOptions(Section):
    mem_fraction_static: float = Field(0.8, gt=0, le=1)
    """Fraction of GPU memory SGLang reserves for weights and KV cache."""
    tp_size: int = Field(1, ge=1)
    """Tensor-parallel size of each SGLang server."""
    skip_tokenizer_init: bool = True
    """Run SGLang without a tokenizer (token-in/token-out)."""
    context_length: int | None = None
    """Override the model's context length (None = the model's own)."""
    extra_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments passed verbatim to `sglang.launch_server`."""

    @field_validator("extra_args")
    @classmethod
    def _no_data_parallel(cls, v: list[str]) -> list[str]:
        # One server is one weight-update group member and one rotation entry: SGLang refuses
        # distributed weight updates with dp_size > 1 (tokenizer manager asserts it).
        for i, arg in enumerate(v):
            name, _, inline = arg.partition("=")
            if name in ("--dp-size", "--dp", "--data-parallel-size"):
                value = inline or (v[i + 1] if i + 1 < len(v) else "")
                if value.strip() != "1":
                    raise ValueError(
                        f"{arg} {'' if inline else value}: SGLang's data parallelism cannot take "
                        "distributed weight updates; run more servers instead (launch.n_servers)")
        return v


class SimOptions(Section):
    """A simulated server's cost model (`launch.server_backend: sim`; docs/scale.md)."""

    gpu: Literal["a100", "h100", "h200"] = "h100"
    """The GPU simulated (its bf16 peak, HBM bandwidth and memory)."""
    model: Literal["1.5b", "7b", "14b", "32b"] = "7b"
    """The model size simulated (Qwen2.5 shapes: parameters and KV bytes per token)."""
    gpus_per_server: int = Field(1, ge=1)
    """Tensor-parallel GPUs of one simulated server."""
    mem_fraction: float = Field(0.85, gt=0, le=1)
    """Share of GPU memory for weights and KV cache."""
    mbu: float = Field(0.7, gt=0, le=1)
    """Achieved share of HBM bandwidth in decode."""
    mfu_decode: float = Field(0.3, gt=0, le=1)
    """Achieved share of peak FLOPs in decode."""
    mfu_prefill: float = Field(0.5, gt=0, le=1)
    """Achieved share of peak FLOPs in prefill."""
    step_overhead_ms: float = Field(2.0, ge=0)
    """Scheduler and launch time of every batch step."""
    length_median: float = Field(512.0, gt=0)
    """Median response length in tokens (lognormal, capped at `max_new_tokens`)."""
    length_sigma: float = Field(1.0, ge=0)
    """Spread of the lognormal lengths (standard deviation of their log)."""
    lengths_file: str | None = None
    """Draw response lengths from this file (one integer per line) instead of the lognormal."""
    weight_gbps: float = Field(25.0, gt=0)
    """Bandwidth of one server's weight update in GB/s (the update holds generation bytes / this long)."""
    time_scale: float = Field(1.0, gt=0)
    """Simulated seconds take this many real seconds (0.01 runs the GPU 100x fast; orchestration
    always runs in real time)."""


class ServerConfig(Section):
    model_path: str | None = None
    """Model directory the servers load at start (None = `actor.model_path`)."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    """Server weight dtype; `auto` = float32 on CPU, bfloat16 on CUDA."""
    host: str = Field("127.0.0.1", min_length=1)
    """Interface the servers of the local launcher bind to. Keep 127.0.0.1 unless other hosts must
    reach them (the Ray and Slurm launchers bind per `launch.cluster_bind`)."""
    base_port: int = Field(0, ge=0, le=65535)
    """First port to try (0 = pick free ports)."""
    api_key: str | None = Field(None, min_length=1)
    """If set, every request except the `/health*` probes must carry `Authorization: Bearer <api_key>`; never logged."""
    random_seed: int | None = None
    """Server sampling seed (None = `experiment.seed`)."""
    max_batch_size: int = Field(64, ge=1)
    """Embedded server: most sequences decoded together in one batch."""
    prompt_cache_entries: int = Field(64, ge=0)
    """Embedded server: prompts whose KV cache is kept, so that a group's samples admitted after
    the first ones (the batch had too few free rows) skip the prompt's forward; cleared on every
    weight update; at most 256 MiB of keys and values. 0 turns it off."""
    context_length: int | None = Field(None, ge=1)
    """Embedded server: longest prompt + completion accepted (None = the model's max positions)."""
    sglang: SGLangOptions = Field(default_factory=SGLangOptions)
    """Options used only when `launch.server_backend` is `sglang`."""
    sim: SimOptions = Field(default_factory=SimOptions)
    """Options used only when `launch.server_backend` is `sim`."""
    strict_sglang: bool = False
    """Embedded server: behave as SGLang where it is unforgiving (`/health` generates and waits while
    paused; weights read back only for SGLang's model classes). Tests run with it on."""
    enable_memory_saver: bool = False
    """Start the servers (SGLang or embedded) with `--enable-memory-saver`, so that they can release
    their weights and KV cache (`/release_memory_occupation`) while the trainer uses the memory: the
    colocated placement needs it. SGLang without it answers a release and frees nothing."""
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    """Embedded server: largest request body in bytes; a bigger `Content-Length` is refused (413)
    before the body is read (see docs/security.md)."""
    max_prompts_per_request: int = Field(1024, ge=1)
    """Embedded server: most prompts in one `/generate` batch."""
    max_request_tokens: int = Field(1 << 20, ge=1)
    """Embedded server: most tokens one `/generate` request asks for (prompts plus
    `max_new_tokens`, summed over its batch)."""
    idle_timeout_s: float = Field(60.0, gt=0)
    """Embedded server: a connection that sends no complete request head this long after
    connecting (or after its last answer) is closed (idle keep-alive, slow-header clients)."""
    body_timeout_s: float = Field(60.0, gt=0)
    """Embedded server: longest wait for a request body once its head arrived (408 after)."""
    allowed_origins: list[str] = Field(default_factory=list)
    """Embedded server: browser origins (`http://host:port`) allowed to call the servers. Every
    other request with an `Origin` header is refused (403), so that a web page open in a browser
    on this host cannot drive them (cross-site request forgery). Empty (the default) suits
    every non-browser client."""

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, v: list[str]) -> list[str]:
        for o in v:
            if "://" not in o or "," in o or not o.strip() or o != o.strip():
                raise ValueError(f"server.allowed_origins: {o!r} is not an origin such as "
                                 "'http://localhost:8080' (scheme://host[:port], no comma)")
        return v
