"""What the local launcher needs of a config beyond its own rules: where the servers are
(`launch.n_servers`, `launch.server_addrs` or AREALITE_SERVER_ADDRS), a shared-memory
weight sync on this host only, CPU pinning that leaves the trainer a core, ports in range."""

from __future__ import annotations

import os
from collections.abc import Mapping

from arealite.config.launch import check_server_addr
from arealite.config.problems import ConfigError, ConfigProblem
from arealite.config.schema import ArealiteConfig
from arealite.utils.net import is_local_host, split_addr

__all__ = ["SERVER_ADDRS_ENV", "check_launch"]

#: Environment variable with comma-separated `host:port` of servers started elsewhere.
SERVER_ADDRS_ENV = "AREALITE_SERVER_ADDRS"


def check_launch(cfg: ArealiteConfig, environ: Mapping[str, str] | None = None) -> list[str]:
    """Checks of the local launcher; returns the external server addresses to use.

    With `launch.n_servers: 0` the servers run elsewhere: their addresses come
    from `launch.server_addrs` or the environment variable AREALITE_SERVER_ADDRS.
    """
    env = os.environ if environ is None else environ
    problems = []
    addrs = list(cfg.launch.server_addrs)
    if cfg.launch.n_servers == 0:
        if not addrs:
            text = env.get(SERVER_ADDRS_ENV, "")
            addrs = [a.strip() for a in text.split(",") if a.strip()]
            for a in addrs:
                try:
                    check_server_addr(a)
                except ValueError as e:
                    problems.append(ConfigProblem(SERVER_ADDRS_ENV, str(e), text, "environment"))
            if not addrs:
                problems.append(ConfigProblem(
                    "launch.server_addrs", "is empty while launch.n_servers = 0: give the "
                    f"addresses of running servers here or in {SERVER_ADDRS_ENV}=host:port,..., "
                    "or set launch.n_servers >= 1 to start servers", [],
                ))
    elif addrs:
        problems.append(ConfigProblem(
            "launch.server_addrs", f"is set but launch.n_servers = {cfg.launch.n_servers} "
            "starts new servers: set launch.n_servers=0 to use these, or remove them", addrs,
        ))
    if cfg.weight_sync.method in ("shm", "tensor"):
        remote = [a for a in addrs if not _addr_is_local(a)]
        if remote:
            m = cfg.weight_sync.method
            problems.append(ConfigProblem(
                "weight_sync.method", f"= {m} needs every server on this host, but {', '.join(remote)} "
                "is not: use weight_sync.method=distributed (or disk)", m,
            ))
    k = cfg.launch.server_cpus
    if k is not None:
        if cfg.launch.n_servers == 0:
            problems.append(ConfigProblem(
                "launch.server_cpus", "pins the servers the launcher starts, but launch.n_servers = 0: "
                "remove it (or pin external servers yourself, e.g. with taskset)", k))
        elif not hasattr(os, "sched_getaffinity"):
            problems.append(ConfigProblem(
                "launch.server_cpus", "needs Linux (os.sched_getaffinity): remove it on this system", k))
        else:
            n_cpus = len(os.sched_getaffinity(0))
            if k >= n_cpus:
                problems.append(ConfigProblem(
                    "launch.server_cpus", f"leaves no core for the trainer: this process may use {n_cpus} "
                    f"core(s); give the servers at most {n_cpus - 1}, or set null for no pinning", k))
            elif k < cfg.launch.n_servers:
                problems.append(ConfigProblem(
                    "launch.server_cpus", f"is fewer than launch.n_servers = {cfg.launch.n_servers}: every "
                    "server needs a core of its own", k))
    if cfg.server.base_port and cfg.server.base_port + max(cfg.launch.n_servers, 1) - 1 > 65535:
        problems.append(ConfigProblem(
            "server.base_port", f"+ launch.n_servers ({cfg.launch.n_servers}) runs past port 65535",
            cfg.server.base_port,
        ))
    if problems:
        raise ConfigError(problems)
    return addrs


def _addr_is_local(addr: str) -> bool:
    try:
        host = split_addr(addr)[0]
    except ValueError:  # reported by the address checks
        return True
    return is_local_host(host)
