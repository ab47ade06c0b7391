"""Run a training script on one machine: servers first, then the trainer under torchrun.

    python -m arealite.launcher.local SCRIPT --config CFG [key=value ...]

1. Loads and validates the config (nothing starts if it is wrong).
2. Picks free ports and starts `launch.n_servers` inference servers (embedded or
   SGLang), each in its own session, each on its own GPU(s) when GPUs are present.
3. Waits for every server's `/health` (`launch.server_startup_timeout_s`); a
   server that exits or never answers fails the launch with its log tail.
4. Runs torchrun (`arealite.launcher.torchrun`: its store listens on 127.0.0.1 alone)
   with `--nproc_per_node launch.n_trainer_procs SCRIPT --config CFG overrides...` and the server
   addresses in AREALITE_SERVER_ADDRS (and the api key, if any, in
   AREALITE_SERVER_API_KEY, which the servers read too: never on a command line,
   never in a log).
5. Echoes the trainer's output and writes every process's log under
   `<output_root>/<name>/<trial>/logs/` (`server0.log`, ..., `trainer.log`). A process the
   trainer starts itself (a local OpenEnv server) registers in `<run>/children/`
   (`utils.procs.register_child`): it is listed with the rest and stopped with the trainer.
6. Tears everything down on success, failure, Ctrl-C or SIGTERM: SIGTERM to each
   child's process group (and to the processes torchrun started in their own
   sessions, and those registered), then SIGKILL after a grace period.

A server that dies mid-run is logged and the run goes on with the others
(`launch.on_server_death=continue`, the default) until the last one dies.

Exit codes (see `ExitCode`): 0 ok, 1 trainer failed, 2 a server failed to
start, 3 the last server (or, with `launch.on_server_death=stop`, any server)
died while the trainer ran, 4 bad arguments or config,
(5 is the cluster launchers' "cluster unreachable or too small"), 130 interrupted (SIGINT / Ctrl-C), 143 terminated (SIGTERM).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Sequence

from arealite.config.run import ENV_ROLLOUT_CPUS, ENV_SERVER_ADDRS, ENV_SERVER_API_KEY
from arealite.launcher.common import (  # noqa: F401  (ExitCode, DEFAULT_ENTRY... are this module's API too)
    DEFAULT_ENTRY,
    TERM_GRACE_S,
    ExitCode,
    LaunchError,
    SignalGuard,
    launch_main,
    log,
    parse_launcher_args,
    server_env,
    start_version,
    trainer_args,
    wait_healthy,
    watch_run,
)
from arealite.launcher import torchrun
from arealite.server.command_line import gpus_per_server, judge_server_command, masked, server_command
from arealite.reward.judge import ADDRS_ENV as JUDGE_ADDRS_ENV
from arealite.utils import procs
from arealite.utils.net import free_port, free_ports, ports_from


LOOPBACK = "127.0.0.1"  # the trainer's store: every rank runs on this machine


def cpu_plan(n_servers: int, server_cpus: int | None, cpus: list[int]) -> tuple[list[list[int]], list[int]]:
    """Cores of each server and of the trainer: the first ``server_cpus`` of ``cpus``
    split evenly (in order) between the servers, the rest to the trainer. No pinning
    (``server_cpus`` None): empty lists."""
    if server_cpus is None or n_servers == 0:
        return [[] for _ in range(n_servers)], []
    if not n_servers <= server_cpus < len(cpus):
        raise ValueError(f"launch.server_cpus={server_cpus} cannot give {n_servers} server(s) a core each "
                         f"and leave one for the trainer out of {len(cpus)}")
    share = [server_cpus // n_servers + (i < server_cpus % n_servers) for i in range(n_servers)]
    plan, start = [], 0
    for n in share:
        plan.append(cpus[start:start + n])
        start += n
    return plan, cpus[server_cpus:]


def _child_setup(cpus: list[int]) -> Callable[[], None]:
    """``preexec_fn`` of a child: the parent-death signal, then its cores (if any)."""
    def setup() -> None:
        procs.die_with_parent(signal.SIGTERM)  # the launcher's SIGKILL leaves no orphan
        if cpus:
            os.sched_setaffinity(0, cpus)
    return setup


@dataclass
class Child:
    """A process the launcher started, in its own session (pgid == pid)."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    log_file: IO | None = None
    addr: str | None = None
    pump: threading.Thread | None = None
    descendants: set[int] = field(default_factory=set)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def remember_descendants(self) -> None:
        """Record the processes below this child; torchrun puts its workers in new sessions.

        Dead pids are dropped so that a recycled pid is never signalled later.
        """
        self.descendants = {p for p in self.descendants if procs.is_alive(p)}
        self.descendants.update(procs.descendants(self.pid))

    def signal_all(self, sig: int) -> None:
        """Send `sig` to this child's process group and to every descendant seen so far."""
        targets = {self.pid} | self.descendants
        for pid in targets:
            for send in (os.killpg, os.kill):
                try:
                    send(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def adopt(self, pid: int) -> None:
        """Stop ``pid`` with this child: a process it started and registered (`procs.register_child`)."""
        self.descendants.add(pid)

    def any_alive(self) -> bool:
        if self.proc.poll() is None:
            return True
        return any(procs.is_alive(p) for p in self.descendants)


def _cuda_device_count() -> int:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return 0
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:  # pragma: no cover - torch is a dependency
        return 0


class LocalLauncher:
    """Starts servers and the trainer, watches them, and always tears them down."""

    def __init__(self, cfg, script: str, config_path: str | None, overrides: Sequence[str],
                 run_dir: Path, echo: IO | None = None, external_addrs: Sequence[str] = ()):
        self.cfg = cfg
        # Servers started elsewhere (`launch.n_servers: 0`), as `check_launch` found them.
        self.external_addrs = list(external_addrs)
        self.script = script
        self.config_path = config_path
        self.overrides = list(overrides)
        self.run_dir = run_dir
        self.log_dir = run_dir / "logs"
        self.children_dir = run_dir / "children"  # what the trainer starts itself registers here
        self.registered: dict[int, str] = {}  # pid -> name, of those the launcher has listed
        self.echo = echo if echo is not None else sys.stdout
        self.servers: list[Child] = []
        self.judges: list[Child] = []  # `agent.judge.n_servers`, outside the policy's rotation
        self.trainer: Child | None = None
        self._signals = SignalGuard()

    # -- signals ---------------------------------------------------------------------------

    def _check_signal(self) -> None:
        self._signals.check()

    def _sleep(self, seconds: float) -> None:
        """Sleep, but wake at once on a signal."""
        self._signals.sleep(seconds)

    # -- servers ---------------------------------------------------------------------------

    def _gpu_plan(self) -> tuple[list[str | None], str | None]:
        """CUDA_VISIBLE_DEVICES per server and for the trainer (None = leave as is)."""
        n_servers = self.cfg.launch.n_servers
        n_gpus = _cuda_device_count()
        if n_gpus == 0:
            return [None] * n_servers, None
        per = gpus_per_server(self.cfg)
        need_servers = n_servers * per
        trainer_n = self.cfg.launch.n_trainer_procs
        if self.cfg.launch.placement != "disaggregated":
            # Colocated or shared: server i's share sits on the GPUs of trainer ranks i*per...(i+1)*per-1.
            if trainer_n > n_gpus:
                raise SystemExit(f"launch.placement={self.cfg.launch.placement}: launch.n_trainer_procs="
                                 f"{trainer_n} trainer GPU(s), but only {n_gpus} visible: lower it")
            plan = [",".join(str((i * per + j) % trainer_n) for j in range(per)) for i in range(n_servers)]
            return plan, ",".join(str(j) for j in range(trainer_n))
        if n_gpus >= need_servers + trainer_n:
            plan = [",".join(str(i * per + j) for j in range(per)) for i in range(n_servers)]
            trainer = ",".join(str(need_servers + j) for j in range(trainer_n))
            return plan, trainer
        if self.cfg.launch.server_backend == "sglang":
            # SGLang takes server.sglang.mem_fraction_static of its GPUs: a trainer there runs out.
            raise SystemExit(
                f"only {n_gpus} GPU(s) for {need_servers} SGLang server GPU(s) (launch.n_servers="
                f"{n_servers} x server.sglang.tp_size={per}) + {trainer_n} trainer GPU(s) "
                f"(launch.n_trainer_procs): a server and a trainer rank never share a GPU; lower "
                "those settings or add GPUs")
        log(f"only {n_gpus} GPUs for {need_servers} server GPUs + {trainer_n} trainer GPUs: "
            "embedded servers and trainer share GPUs")
        plan = [",".join(str((i * per + j) % n_gpus) for j in range(per)) for i in range(n_servers)]
        return plan, None

    def start_version(self) -> int:
        """The policy version the servers start at (`common.start_version`)."""
        return start_version(self.cfg)

    def _cpu_plan(self) -> tuple[list[list[int]], list[int]]:
        """Cores per server and for the trainer (`launch.server_cpus`; empty = not pinned)."""
        k = self.cfg.launch.server_cpus
        n = self.cfg.launch.n_servers
        if k is None or n == 0:
            return [[] for _ in range(n)], []
        return cpu_plan(n, k, sorted(os.sched_getaffinity(0)))

    def start_servers(self) -> list[str]:
        """Start the servers; return their `host:port` addresses."""
        cfg = self.cfg
        n = cfg.launch.n_servers
        host = cfg.server.host
        ports = (ports_from(cfg.server.base_port, n, host) if cfg.server.base_port
                 else free_ports(n, host))
        gpu_plan, _ = self._gpu_plan()
        cpus, _ = self._cpu_plan()
        for i, port in enumerate(ports):
            cmd = server_command(cfg, port, i, weight_version=self.start_version())
            env = dict(os.environ, **server_env(cfg))
            if gpu_plan[i] is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpu_plan[i]
            self.servers.append(self._spawn(f"server{i}", cmd, env, cpus[i], f"{host}:{port}"))
        return [s.addr for s in self.servers]

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str], cpus: list[int], addr: str) -> Child:
        """Start one server in its own session, its output in `logs/<name>.log`."""
        log_path = self.log_dir / f"{name}.log"
        log_file = open(log_path, "ab", buffering=0)
        log_file.write(f"[launcher] {masked(cmd)}\n".encode())
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            env=env, start_new_session=True, preexec_fn=_child_setup(cpus),
        )
        pinned = f" on cores {cpus}" if cpus else ""
        log(f"started {name} (pid {proc.pid}) on {addr}{pinned}; log: {log_path}")
        return Child(name, proc, log_path, log_file, addr=addr)

    def start_judges(self) -> list[str]:
        """Start the `agent.judge.n_servers` judge servers (embedded, on free ports, not pinned);
        return their addresses. The trainer gets them in AREALITE_JUDGE_ADDRS."""
        judge, host = self.cfg.agent.judge, self.cfg.server.host
        taken = {int(s.addr.rpartition(":")[2]) for s in self.servers if s.addr}
        ports = free_ports(judge.n_servers, host)
        while taken & set(ports):  # a policy server may not have bound its port yet
            ports = free_ports(judge.n_servers, host)
        env = {k: v for k, v in os.environ.items() if k != ENV_SERVER_API_KEY}
        if judge.api_key:
            env[ENV_SERVER_API_KEY] = judge.api_key  # the judges' own key, never the policy's
        for i, port in enumerate(ports):
            self.judges.append(self._spawn(f"judge{i}", judge_server_command(self.cfg, port, i), env, [],
                                           f"{host}:{port}"))
        return [j.addr for j in self.judges]

    def wait_servers(self) -> None:
        """Wait until every server answers /health, or fail with the log tail of the culprit."""
        wait_healthy(self.servers, self.cfg.launch.server_startup_timeout_s, self.cfg.server.api_key,
                     self._sleep)
        if self.judges:
            wait_healthy(self.judges, self.cfg.launch.server_startup_timeout_s, self.cfg.agent.judge.api_key,
                         self._sleep)

    # -- trainer ---------------------------------------------------------------------------

    def trainer_command(self) -> list[str]:
        """torchrun ... `SCRIPT --config CFG overrides`, its store on a free port of 127.0.0.1 alone
        (`arealite.launcher.torchrun`; torchrun's ``--standalone`` listens on every interface)."""
        return [*torchrun.command(sys.executable, master_addr=LOOPBACK, master_port=free_port(LOOPBACK),
                                  nproc_per_node=self.cfg.launch.n_trainer_procs),
                *trainer_args(self.script, self.config_path, self.overrides)]

    def start_trainer(self, addrs: list[str]) -> Child:
        env = dict(os.environ)
        env.update(self.cfg.launch.trainer_env)
        env[ENV_SERVER_ADDRS] = ",".join(addrs)
        if self.judges:
            env[JUDGE_ADDRS_ENV] = ",".join(j.addr for j in self.judges)
        if self.cfg.server.api_key:
            env[ENV_SERVER_API_KEY] = self.cfg.server.api_key
        env["PYTHONUNBUFFERED"] = "1"
        env[procs.ENV_CHILDREN_DIR] = str(self.children_dir)
        _, trainer_gpus = self._gpu_plan()
        if trainer_gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = trainer_gpus
        cmd = self.trainer_command()
        log_path = self.log_dir / "trainer.log"
        log_file = open(log_path, "ab", buffering=0)
        log_file.write(f"[launcher] {masked(cmd)}\n".encode())
        server_cpus, cpus = self._cpu_plan()
        if cpus:
            # The trainers' rollout workers (HTTP, workflows) run beside the servers, off the
            # cores that train.
            env.setdefault(ENV_ROLLOUT_CPUS, ",".join(str(c) for plan in server_cpus for c in plan))
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=env, start_new_session=True, preexec_fn=_child_setup(cpus),
        )
        if cpus:
            log(f"trainer processes pinned to cores {cpus}, their rollout workers to {env[ENV_ROLLOUT_CPUS]}")
        child = Child("trainer", proc, log_path, log_file)
        child.pump = threading.Thread(target=self._pump, args=(child,), daemon=True,
                                      name="trainer-log")
        child.pump.start()
        self.trainer = child
        log(f"started trainer (pid {proc.pid}); log: {log_path}")
        return child

    def _pump(self, child: Child) -> None:
        """Copy the trainer's output to its log file and to the console, line by line."""
        assert child.proc.stdout is not None
        for line in iter(child.proc.stdout.readline, b""):
            child.log_file.write(line)
            try:
                self.echo.write(line.decode(errors="replace"))
                self.echo.flush()
            except (OSError, ValueError):  # console closed: keep logging to the file
                pass

    def watch(self) -> ExitCode:
        """Wait for the trainer; stop early on a signal, or when servers die (`common.watch_run`)."""
        assert self.trainer is not None

        def tick(i: int) -> None:
            # torchrun spawns its workers in their own sessions: keep a record of them so
            # that teardown reaches them even after torchrun itself is gone.
            if i % 5 == 0:
                self.trainer.remember_descendants()
                self._adopt_registered()

        code = watch_run(self.cfg, self.trainer, self.servers, self._sleep, tick=tick)
        if self.trainer.pump is not None:
            self.trainer.pump.join(timeout=5)
        return code

    def _adopt_registered(self) -> None:
        """List the processes the trainer started and registered, and stop them with it."""
        if self.trainer is None:
            return
        for name, pid in procs.registered_children(self.children_dir):
            if pid in self.registered:
                continue
            label = f"{name}{sum(n.rstrip('0123456789') == name for n in self.registered.values())}"
            self.registered[pid] = label
            self.trainer.adopt(pid)
            log(f"the trainer started {label} (pid {pid}); log: {self.trainer.log_path}")

    # -- teardown --------------------------------------------------------------------------

    def teardown(self) -> None:
        """SIGTERM every child (trainer first), SIGKILL what is left after the grace period."""
        children = ([self.trainer] if self.trainer else []) + self.servers + self.judges
        self._adopt_registered()
        for c in children:
            c.remember_descendants()
            if c.any_alive():
                c.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE_S
        while time.monotonic() < deadline and any(c.any_alive() for c in children):
            time.sleep(0.1)
        for c in children:
            if c.any_alive():
                log(f"{c.name} did not stop within {TERM_GRACE_S:g}s of SIGTERM: SIGKILL")
                c.remember_descendants()
                c.signal_all(signal.SIGKILL)
        for c in children:
            try:
                c.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log(f"{c.name} (pid {c.pid}) could not be reaped")
            if c.pump is not None:
                c.pump.join(timeout=2)
            if c.log_file is not None:
                c.log_file.close()

    # -- all together ----------------------------------------------------------------------

    def run(self) -> int:
        """Launch, watch and tear down; return the exit code (see `ExitCode`)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children_dir.mkdir(exist_ok=True)
        for old in self.children_dir.iterdir():  # a resumed run's: those processes are gone
            old.unlink()
        return self._signals.run(self._launch, self.teardown)

    def _launch(self) -> int:
        if self.cfg.launch.n_servers > 0:
            addrs = self.start_servers()
            if self.cfg.agent.judge.n_servers:
                self.start_judges()
            self.wait_servers()
        else:
            if not self.external_addrs:
                raise LaunchError(
                    f"launch.n_servers=0 but no server addresses: set launch.server_addrs or "
                    f"{ENV_SERVER_ADDRS}=host:port,...", ExitCode.BAD_CONFIG)
            addrs = self.external_addrs
            log(f"using servers started elsewhere: {','.join(addrs)}")
            if self.cfg.agent.judge.n_servers:
                self.start_judges()
                self.wait_servers()
        self._check_signal()
        self.start_trainer(addrs)
        return int(self.watch())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m arealite.launcher.local`; returns the exit code."""
    return launch_main(argv, "python -m arealite.launcher.local",
                       "Start inference servers, then run the trainer under torchrun", LocalLauncher)


if __name__ == "__main__":
    sys.exit(main())
