"""The pieces of a Slurm job that run inside its steps (see `arealite.launcher.slurm`).

    python -m arealite.launcher.slurm_task server --addr-dir D --config CFG [overrides]
    python -m arealite.launcher.slurm_task wait-servers --addr-dir D --step-pid P --config CFG [overrides]

`server` is one task of the servers' `srun` step: it picks its node's address
(`launch.cluster_bind`) and a free port, writes `host:port` to `D/server<SLURM_PROCID>`,
then replaces itself with the server (so that Slurm's signals reach the server itself).
The API key comes from the config or AREALITE_SERVER_API_KEY, never the command line.

`wait-servers` runs in the batch script: it waits for every address file and every
`/health` (`launch.server_startup_timeout_s`), failing with the culprit's log tail, and
prints the addresses, comma-separated, for AREALITE_SERVER_ADDRS.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Sequence

from arealite.config.run import run_dir
from arealite.launcher.common import ExitCode, LaunchError, log, server_env, start_version, wait_healthy
from arealite.server.command_line import masked, server_command
from arealite.utils import procs
from arealite.utils.net import ENV_HOST_IP, free_port, host_ip


def run_server(cfg, addr_dir: Path, index: int) -> None:
    """Write this task's address, then exec the server (does not return)."""
    ip = host_ip()
    bind = ip if cfg.launch.cluster_bind == "node_ip" else "0.0.0.0"
    port = cfg.server.base_port + index if cfg.server.base_port else free_port(bind)
    cmd = server_command(cfg, port, index, weight_version=start_version(cfg), host=bind)
    tmp = addr_dir / f".server{index}.tmp"
    tmp.write_text(f"{ip}:{port}")
    os.replace(tmp, addr_dir / f"server{index}")
    print(f"[slurm_task] server{index} on {ip}:{port}: {masked(cmd)}", flush=True)
    env = dict(os.environ, **server_env(cfg), **{ENV_HOST_IP: ip})
    os.execve(cmd[0], cmd, env)


class _StepServer:
    """A server of the step, as `wait_healthy` watches it: dead when the step is."""

    def __init__(self, index: int, addr: str, log_path: Path, step_pid: int):
        self.name, self.addr, self.log_path, self.step_pid = f"server{index}", addr, log_path, step_pid

    def poll(self) -> int | None:
        return None if procs.is_alive(self.step_pid) else 1


def wait_servers(cfg, addr_dir: Path, step_pid: int) -> list[str]:
    """Addresses of every server once all answer /health (LaunchError otherwise)."""
    n = cfg.launch.n_servers
    timeout = cfg.launch.server_startup_timeout_s
    deadline = time.monotonic() + timeout
    files = [addr_dir / f"server{i}" for i in range(n)]
    while not all(f.exists() for f in files):
        if not procs.is_alive(step_pid) or time.monotonic() > deadline:
            missing = [f.name for f in files if not f.exists()]
            raise LaunchError(f"{', '.join(missing)} never reported an address (see "
                              f"{run_dir(cfg) / 'logs'}/server*.log; launch.server_startup_timeout_s="
                              f"{timeout:g})", ExitCode.SERVER_START_FAILED)
        time.sleep(0.5)
    logs = run_dir(cfg) / "logs"
    servers = [_StepServer(i, f.read_text().strip(), logs / f"server{i}.log", step_pid)
               for i, f in enumerate(files)]
    wait_healthy(servers, max(deadline - time.monotonic(), 1.0), cfg.server.api_key, time.sleep)
    return [s.addr for s in servers]


def main(argv: Sequence[str] | None = None) -> int:
    from arealite.config.loader import load_config

    p = argparse.ArgumentParser(prog="python -m arealite.launcher.slurm_task")
    p.add_argument("what", choices=("server", "wait-servers"))
    p.add_argument("--addr-dir", required=True, type=Path)
    p.add_argument("--step-pid", type=int, default=0)
    p.add_argument("--config", default=None)
    args, overrides = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    cfg = load_config(args.config, overrides)
    if args.what == "server":
        run_server(cfg, args.addr_dir, int(os.environ.get("SLURM_PROCID", "0")))
    try:
        print(",".join(wait_servers(cfg, args.addr_dir, args.step_pid)), flush=True)
    except LaunchError as e:
        log(str(e))
        return int(e.code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
