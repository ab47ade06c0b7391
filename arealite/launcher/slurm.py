"""Run the same training as a Slurm batch job: write an sbatch script and submit it.

    python -m arealite.launcher.slurm [SCRIPT|MODULE] --config CFG [--no-submit] [--wait] [key=value ...]

The script (`<run dir>/slurm/job.sbatch`) runs on the job's first node and:

1. starts the servers as one `srun` step of `launch.n_servers` tasks on the server nodes
   (`launch.slurm.server_nodes`, or the trainer nodes when 0); each task
   (`arealite.launcher.slurm_task server`) binds its node's IP (`launch.cluster_bind`), a
   free port, writes its address under `<run dir>/slurm/`, then becomes the server;
2. waits for every address and `/health` (`slurm_task wait-servers`, exit 2 on failure);
3. runs the trainer as one `srun` step, one `torchrun` per trainer node with a c10d
   rendezvous on the first trainer node (`launch.slurm.rendezvous_port`) and the server
   addresses in AREALITE_SERVER_ADDRS;
4. watches both steps: the trainer's exit is the job's (0 or 1); the server step ending
   first is exit 3. `launch.on_server_death=stop` makes the server step end as soon as any
   server fails (`srun --kill-on-bad-exit=1`); with `continue` it ends when the last does;
5. on any exit (and on SIGTERM/SIGINT, e.g. `scancel`) stops both steps: SIGTERM, then
   SIGKILL after a grace period.

Logs: `<run dir>/logs/server<i>.log` (one per server task), `trainer<n>.log` (one per
trainer node), `slurm-<jobid>.out` (the script itself). The API key, when set, goes in a
file readable by the user alone (`<run dir>/slurm/api_key`), exported to the steps in the
environment; no command line carries it. The run directory must be on a shared filesystem.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from arealite.config.run import ENV_SERVER_API_KEY
from arealite.launcher.common import (
    TERM_GRACE_S,
    ExitCode,
    load_checked_config,
    log,
    parse_launcher_args,
    trainer_args,
)


def _q(args: Sequence[str]) -> str:
    return " ".join(shlex.quote(str(a)) for a in args)


def check_slurm(cfg) -> None:
    """Raise ValueError naming the fields when the job cannot be laid out."""
    s = cfg.launch.slurm
    if cfg.launch.n_trainer_procs % s.trainer_nodes:
        raise ValueError(f"launch.n_trainer_procs={cfg.launch.n_trainer_procs} does not divide evenly among "
                         f"launch.slurm.trainer_nodes={s.trainer_nodes} (torchrun runs the same number per node)")
    if s.server_nodes > max(cfg.launch.n_servers, 0) and cfg.launch.n_servers:
        raise ValueError(f"launch.slurm.server_nodes={s.server_nodes} is more than launch.n_servers="
                         f"{cfg.launch.n_servers}: a server node would stay idle")
    if cfg.launch.n_servers == 0 and s.server_nodes:
        raise ValueError("launch.slurm.server_nodes is set but launch.n_servers = 0 (servers run elsewhere)")
    if cfg.agent.judge.n_servers:
        raise ValueError("agent.judge.n_servers: the Slurm launcher does not start judge servers (the local "
                         "launcher does); start them in the job and set agent.judge.addrs")


def _header(cfg, run_dir: Path) -> list[str]:
    s = cfg.launch.slurm
    nodes = s.trainer_nodes + s.server_nodes
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name=arealite-{cfg.experiment.name}-{cfg.experiment.trial}",
             f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1",
             f"#SBATCH --output={run_dir / 'logs' / 'slurm-%j.out'}"]
    for flag, value in (("--partition", s.partition), ("--account", s.account), ("--time", s.time_limit),
                        ("--gpus-per-node", s.gpus_per_node or None), ("--cpus-per-task", s.cpus_per_node)):
        if value is not None:
            lines.append(f"#SBATCH {flag}={value}")
    lines += [f"#SBATCH {a}" for a in s.sbatch_args]
    return lines


def sbatch_script(cfg, script: str, config_path: str | None, overrides: Sequence[str], run_dir: Path,
                  key_file: Path | None = None) -> str:
    """The text of the batch script (see the module docstring for what it does)."""
    s = cfg.launch.slurm
    n_servers, t_nodes = cfg.launch.n_servers, s.trainer_nodes
    run_dir = run_dir.resolve()
    conf = ["--config", str(Path(config_path).resolve())] if config_path else []
    ovr = [o for o in overrides if not o.startswith("server.api_key=")]
    task = [sys.executable, "-m", "arealite.launcher.slurm_task"]
    per_node = cfg.launch.n_trainer_procs // t_nodes
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(t_nodes),
                "--nproc_per_node", str(per_node), "--rdzv_backend", "c10d"]
    srv_nodes = max(1, min(n_servers, s.server_nodes or t_nodes))
    kill_on_bad = 1 if cfg.launch.on_server_death == "stop" else 0
    body = f'''
# Written by `python -m arealite.launcher.slurm`; re-running that command resumes the run.
set -uo pipefail
cd {shlex.quote(os.getcwd())}
RUN_DIR={shlex.quote(str(run_dir))}
ADDRS="$RUN_DIR/slurm/addrs.$SLURM_JOB_ID"
mkdir -p "$RUN_DIR/logs" "$ADDRS"
{f'export {ENV_SERVER_API_KEY}="$(cat {shlex.quote(str(key_file))})"' if key_file else '# no API key'}
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
TRAINER_NODES=$(IFS=,; echo "${{NODES[*]:0:{t_nodes}}}")
SERVER_NODES=$(IFS=,; echo "${{NODES[*]:{t_nodes if s.server_nodes else 0}:{srv_nodes}}}")
STEPS=()
stop_steps() {{
    trap - EXIT TERM INT
    kill -TERM "${{STEPS[@]}}" 2>/dev/null
    for _ in $(seq {int(TERM_GRACE_S * 2)}); do
        kill -0 "${{STEPS[@]}}" 2>/dev/null || break
        sleep 0.5
    done
    kill -KILL "${{STEPS[@]}}" 2>/dev/null
    wait 2>/dev/null
}}
trap stop_steps EXIT
trap 'echo "[arealite] SIGTERM: stopping"; exit 143' TERM
trap 'echo "[arealite] SIGINT: stopping"; exit 130' INT
'''
    if n_servers:
        body += f'''
# 1. the servers: one step, one task per server
srun --nodes={srv_nodes} --ntasks={n_servers} --nodelist="$SERVER_NODES" --overlap --overcommit \\
    --kill-on-bad-exit={kill_on_bad} --output="$RUN_DIR/logs/server%t.log" \\
    {_q(task)} server --addr-dir "$ADDRS" {_q(conf + ovr)} &
SERVER_STEP=$!
STEPS+=($SERVER_STEP)
# 2. their addresses, once every one answers /health
export AREALITE_SERVER_ADDRS="$({_q(task)} wait-servers --addr-dir "$ADDRS" --step-pid $SERVER_STEP \\
    {_q(conf + ovr)})" || exit {int(ExitCode.SERVER_START_FAILED)}
echo "[arealite] servers: $AREALITE_SERVER_ADDRS"
'''
    else:
        body += "SERVER_STEP=\n"
    body += f'''
# 3. the trainer: one torchrun per trainer node, rendezvous on the first one
RDZV_HOST="${{NODES[0]}}"
srun --nodes={t_nodes} --ntasks={t_nodes} --nodelist="$TRAINER_NODES" --overlap --kill-on-bad-exit=1 \\
    --output="$RUN_DIR/logs/trainer%n.log" \\
    {_q(torchrun)} --rdzv_endpoint "$RDZV_HOST:{s.rendezvous_port}" --rdzv_id "$SLURM_JOB_ID" \\
    {_q(trainer_args(script, None, []))} {_q(conf + ovr)} &
TRAINER_STEP=$!
STEPS+=($TRAINER_STEP)
# 4. watch: the trainer's exit is the job's; the server step ending first stops it
while kill -0 $TRAINER_STEP 2>/dev/null; do
    if [ -n "$SERVER_STEP" ] && ! kill -0 $SERVER_STEP 2>/dev/null; then
        echo "[arealite] the server step ended while training (launch.on_server_death={cfg.launch.on_server_death})"
        exit {int(ExitCode.SERVER_DIED)}
    fi
    sleep 1
done
wait $TRAINER_STEP
rc=$?
echo "[arealite] trainer exited with $rc"
[ $rc -eq 0 ] && exit 0
exit {int(ExitCode.TRAINER_FAILED)}
'''
    return "\n".join(_header(cfg, run_dir)) + "\n" + body


def write_job(cfg, script: str, config_path: str | None, overrides: Sequence[str], run_dir: Path) -> Path:
    """Write `<run dir>/slurm/job.sbatch` (and the key file, mode 0600); returns the script's path."""
    out = run_dir / "slurm"
    out.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    key_file = None
    if cfg.server.api_key:
        key_file = out / "api_key"
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(cfg.server.api_key)
    path = out / "job.sbatch"
    path.write_text(sbatch_script(cfg, script, config_path, overrides, run_dir, key_file))
    return path


def _options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-submit", action="store_true", help="write the sbatch script only")
    p.add_argument("--wait", action="store_true", help="wait for the job to end (sbatch --wait); "
                                                       "exit with its code")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m arealite.launcher.slurm`; returns the exit code."""
    args = parse_launcher_args(sys.argv[1:] if argv is None else argv, prog="python -m arealite.launcher.slurm",
                               what="Write and submit a Slurm batch job of servers and trainers",
                               add_options=_options)
    try:
        cfg, _ = load_checked_config(args)
        check_slurm(cfg)
    except ValueError as e:  # ConfigError is a ValueError
        log(f"bad config: {e}")
        return int(ExitCode.BAD_CONFIG)
    run_dir = Path(cfg.experiment.output_root) / cfg.experiment.name / cfg.experiment.trial
    path = write_job(cfg, args.script, args.config, args.overrides, run_dir)
    log(f"wrote {path}")
    if args.no_submit:
        return 0
    cmd = ["sbatch", "--parsable", *(["--wait"] if args.wait else []), str(path)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        log("sbatch not found: is this a Slurm login node? (--no-submit writes the script only)")
        return int(ExitCode.CLUSTER_UNAVAILABLE)
    job = res.stdout.strip().split(";")[0]
    if job:
        log(f"submitted job {job}; logs in {run_dir / 'logs'}")
    if res.returncode != 0:
        log(f"sbatch exited with {res.returncode}: {res.stderr.strip()}")
        return res.returncode if args.wait and job else int(ExitCode.CLUSTER_UNAVAILABLE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
