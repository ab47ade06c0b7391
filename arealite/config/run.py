"""Where a run lives and what it talks to, from its config and the launcher's environment:
the run directory, the inference servers' addresses and API key, and the environment
variables the launcher passes them in."""

from __future__ import annotations

import os
from pathlib import Path

from arealite.config.schema import ArealiteConfig

ENV_SERVER_ADDRS = "AREALITE_SERVER_ADDRS"
ENV_SERVER_API_KEY = "AREALITE_SERVER_API_KEY"
#: Cores for the trainers' rollout workers (comma-separated); the launcher sets the servers' cores.
ENV_ROLLOUT_CPUS = "AREALITE_ROLLOUT_CPUS"


def run_dir(cfg: ArealiteConfig) -> Path:
    """``<output_root>/<name>/<trial>``: logs, stats, checkpoints and plots of a run."""
    e = cfg.experiment
    return Path(e.output_root) / e.name / e.trial


def server_addrs(cfg: ArealiteConfig) -> list[str]:
    """Inference servers: the launcher's environment variable, else ``launch.server_addrs``."""
    env = os.environ.get(ENV_SERVER_ADDRS, "")
    addrs = [a.strip() for a in env.split(",") if a.strip()] or list(cfg.launch.server_addrs)
    if not addrs:
        raise RuntimeError(
            f"no inference server address: run under `python -m arealite.launcher.local`, or set "
            f"{ENV_SERVER_ADDRS}=host:port[,host:port...] or launch.server_addrs"
        )
    return addrs


def server_api_key(cfg: ArealiteConfig) -> str | None:
    return os.environ.get(ENV_SERVER_API_KEY) or cfg.server.api_key
