"""Command lines of a run's inference servers (the launchers start them; the planner reads them).

Two backends speak the same HTTP protocol: arealite's embedded server (CPU or
GPU, PyTorch) and SGLang (GPU). Both command lines are built from the config
here, in one place, so that they can be unit-tested without starting anything.
No command line carries the API key: it travels in AREALITE_SERVER_API_KEY.
"""

from __future__ import annotations

import sys
from typing import Sequence

from arealite.config.schema import ArealiteConfig

#: Flags whose value is a secret: shown as *** wherever a command is printed.
SECRET_FLAGS = ("--api-key",)
#: Config overrides whose value is secret.
SECRET_OVERRIDES = ("server.api_key",)


def memory_saver(cfg: ArealiteConfig) -> bool:
    """Whether the servers start with ``--enable-memory-saver``: asked for, or needed by the
    time-shared placement, which releases their memory every step (docs/placement.md)."""
    return cfg.server.enable_memory_saver or cfg.launch.placement == "colocated"


def server_model_path(cfg: ArealiteConfig) -> str:
    """The model directory the servers load: `server.model_path`, else `actor.model_path`."""
    path = cfg.server.model_path or cfg.actor.model_path
    if not path:
        raise ValueError(
            "server.model_path and actor.model_path are both empty: set one of them to a "
            "Hugging Face model directory (e.g. `python -m arealite.models.tiny DIR` builds one)"
        )
    return path


def server_seed(cfg: ArealiteConfig, index: int) -> int:
    """Sampling seed of server `index`: distinct per server, reproducible per run."""
    base = cfg.server.random_seed if cfg.server.random_seed is not None else cfg.experiment.seed
    return base + index


def embedded_server_command(cfg: ArealiteConfig, port: int, index: int = 0, weight_version: int = 0,
                            host: str | None = None, model_path: str | None = None) -> list[str]:
    """`python -m arealite.server ...` for server number `index` on `port` (serving
    `model_path`, default the policy's `server_model_path`)."""
    s = cfg.server
    cmd = [
        sys.executable, "-m", "arealite.server",
        "--model-path", model_path or server_model_path(cfg),
        "--host", host or s.host,
        "--port", str(port),
        "--random-seed", str(server_seed(cfg, index)),
        "--max-batch-size", str(s.max_batch_size),
        "--prompt-cache-entries", str(s.prompt_cache_entries),
        "--weight-version", str(weight_version),
        # A receive from a group whose member died ends at this timeout (see weight_sync.timeout_s).
        "--weight-sync-timeout-s", str(cfg.weight_sync.timeout_s),
    ]
    if s.strict_sglang:
        cmd.append("--strict-sglang")
    if memory_saver(cfg):
        cmd.append("--enable-memory-saver")
    # `auto` is the server's own default (float32 on CPU, bfloat16 on CUDA).
    if s.dtype != "auto":
        cmd += ["--dtype", s.dtype]
    if s.context_length is not None:
        cmd += ["--context-length", str(s.context_length)]
    if s.quantization is not None and model_path is None:  # the policy's servers (not a judge's)
        cmd += ["--quantization", s.quantization]
    cmd += embedded_limit_args(cfg)
    cmd += routing_replay_args(cfg)
    # `server.api_key` is read from AREALITE_SERVER_API_KEY (`common.server_env`), never argv.
    return cmd


def embedded_limit_args(cfg: ArealiteConfig) -> list[str]:
    """The request limits of `server` (docs/security.md) as embedded-server flags."""
    s = cfg.server
    out = ["--max-body-bytes", str(s.max_body_bytes), "--max-prompts", str(s.max_prompts_per_request),
           "--max-request-tokens", str(s.max_request_tokens), "--idle-timeout-s", str(s.idle_timeout_s),
           "--body-timeout-s", str(s.body_timeout_s)]
    if s.allowed_origins:
        out += ["--allowed-origins", ",".join(s.allowed_origins)]
    return out


def sglang_server_command(cfg: ArealiteConfig, port: int, index: int = 0, weight_version: int = 0,
                          host: str | None = None) -> list[str]:
    """`python -m sglang.launch_server ...` for server number `index` on `port`.

    ``--weight-version`` is the version the run starts from (SGLang reports "default"
    otherwise, which is no version at all)."""
    s = cfg.server
    o = s.sglang
    # With a key, a small wrapper adds `--api-key` from the environment inside the process,
    # so that the key never shows on a command line (`ps`, logs).
    entry = "arealite.launcher.sglang_server" if s.api_key else "sglang.launch_server"
    cmd = [
        sys.executable, "-m", entry,
        "--model-path", server_model_path(cfg),
        "--host", host or s.host,
        "--port", str(port),
        "--tp-size", str(o.tp_size),
        "--mem-fraction-static", str(o.mem_fraction_static),
        # SGLang's `auto` takes the checkpoint's dtype; arealite's `auto` means bf16 on GPUs.
        "--dtype", "bfloat16" if s.dtype == "auto" else s.dtype,
        "--random-seed", str(server_seed(cfg, index)),
        "--weight-version", str(weight_version),
    ]
    if o.skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    if memory_saver(cfg):  # /release_memory_occupation frees nothing without it
        cmd.append("--enable-memory-saver")
    context_length = o.context_length if o.context_length is not None else s.context_length
    if context_length is not None:
        cmd += ["--context-length", str(context_length)]
    if s.quantization is not None:  # from an FP8 block checkpoint: server.model_path (docs/precision.md)
        cmd += ["--quantization", s.quantization]
    cmd += sglang_lora_args(cfg)
    cmd += routing_replay_args(cfg)
    cmd += list(o.extra_args)
    return cmd


def routing_replay_args(cfg: ArealiteConfig) -> list[str]:
    """With `algorithm.routing_replay: r3` the servers record the experts an MoE model routes each
    token to (SGLang's flag, which the embedded server shares; docs/moe.md)."""
    return ["--enable-return-routed-experts"] if cfg.algorithm.routing_replay == "r3" else []


def sglang_lora_args(cfg: ArealiteConfig) -> list[str]:
    """SGLang's LoRA flags for `actor.lora` (none without it): adapters are loaded at run time
    (`/load_lora_adapter`), so SGLang needs the largest rank and the target modules up front."""
    lora = cfg.actor.lora
    if lora is None:
        return []
    return ["--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules", *lora.target_modules]


def server_command(cfg: ArealiteConfig, port: int, index: int = 0, weight_version: int = 0,
                   host: str | None = None) -> list[str]:
    """The command line of server `index` for `launch.server_backend`, bound to `host`
    (default `server.host`; the cluster launchers pass the node's address)."""
    if cfg.launch.server_backend == "sglang":
        return sglang_server_command(cfg, port, index, weight_version, host)
    cmd = embedded_server_command(cfg, port, index, weight_version, host)
    if cfg.launch.server_backend == "sim":  # the embedded server's flags, served by the simulator
        return [sys.executable, "-m", "arealite.sim", *cmd[3:], *sim_args(cfg)]
    return cmd


def sim_args(cfg: ArealiteConfig) -> list[str]:
    """`server.sim` as the flags of a simulated server (`python -m arealite.sim`)."""
    o = cfg.server.sim
    out: list[str] = []
    for name, value in o.model_dump().items():
        if name == "lengths_file":
            out += ["--sim-lengths-file", value] if value else []
        else:
            out += ["--sim-" + name.replace("_", "-"), str(value)]
    return out


def check_sim_backend(cfg: ArealiteConfig) -> None:
    """What a run on simulated servers cannot do; raises ValueError naming the field and the fix."""
    if cfg.launch.server_backend != "sim":
        return
    if cfg.weight_sync.probe:
        raise ValueError("weight_sync.probe: simulated servers (launch.server_backend=sim) make up their "
                         "log-probs, so the probe cannot agree with the trainer; set weight_sync.probe=false")


def judge_server_command(cfg: ArealiteConfig, port: int, index: int = 0) -> list[str]:
    """The command line of judge server `index` (`agent.judge.n_servers`): the embedded server
    on `agent.judge.model_path`, with the `server` section's dtype and batch size, a seed of
    its own, and no weight updates (its version stays 0)."""
    path = cfg.agent.judge.model_path
    if not path:
        raise ValueError("agent.judge.n_servers > 0 needs agent.judge.model_path (the judge model)")
    return embedded_server_command(cfg, port, index=10_000 + index, model_path=path)


def gpus_per_server(cfg: ArealiteConfig) -> int:
    """GPUs one server uses (its tensor-parallel size on SGLang, 1 for embedded)."""
    return cfg.server.sglang.tp_size if cfg.launch.server_backend == "sglang" else 1


def masked(cmd: Sequence[str]) -> str:
    """The command as one printable string with secret values replaced by ***."""
    out: list[str] = []
    hide_next = False
    for arg in cmd:
        if hide_next:
            out.append("***")
            hide_next = False
        elif arg in SECRET_FLAGS:
            out.append(arg)
            hide_next = True
        elif any(arg.startswith(f + "=") for f in SECRET_FLAGS + SECRET_OVERRIDES):
            out.append(arg.split("=", 1)[0] + "=***")
        else:
            out.append(arg)
    return " ".join(out)
