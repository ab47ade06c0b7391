"""Run a training script on one machine: servers first, then the trainer under torchrun.

    python -m arealite.launcher.local SCRIPT --config CFG [key=value ...]

1. Loads and validates the config (nothing starts if it is wrong).
2. Picks free ports and starts `launch.n_servers` inference servers (embedded or
   SGLang), each in its own session, each on its own GPU(s) when GPUs are present.
3. Waits for every server's `/health` (`launch.server_startup_timeout_s`); a
   server that exits or never answers fails the launch with its log tail.
4. Runs `python -m torch.distributed.run --standalone --nproc_per_node
   launch.n_trainer_procs SCRIPT --config CFG overrides...` with the server
   addresses in AREALITE_SERVER_ADDRS (and the api key, if any, in
   AREALITE_SERVER_API_KEY: never on a command line, never in a log).
5. Echoes the trainer's output and writes every process's log under
   `<output_root>/<name>/<trial>/logs/` (`server0.log`, ..., `trainer.log`).
6. Tears everything down on success, failure, Ctrl-C or SIGTERM: SIGTERM to each
   child's process group (and to the processes torchrun started in their own
   sessions), then SIGKILL after a grace period.

A server that dies mid-run is logged and the run goes on with the others
(`launch.on_server_death=continue`, the default) until the last one dies.

Exit codes (see `ExitCode`): 0 ok, 1 trainer failed, 2 a server failed to
start, 3 the last server (or, with `launch.on_server_death=stop`, any server)
died while the trainer ran, 4 bad arguments or config,
130 interrupted (SIGINT / Ctrl-C), 143 terminated (SIGTERM).
"""

from __future__ import annotations

import argparse
import enum
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Sequence

from arealite.launcher.server_cmd import gpus_per_server, masked, server_command
from arealite.utils import procs
from arealite.utils.run import ENV_ROLLOUT_CPUS, ENV_SERVER_ADDRS, ENV_SERVER_API_KEY, complete_checkpoints, run_dir
from arealite.utils.net import free_ports, ports_from


#: Seconds between SIGTERM and SIGKILL when tearing a child down.
TERM_GRACE_S = float(os.environ.get("AREALITE_LAUNCHER_GRACE_S", "10"))
#: Lines of a server's log shown when it fails.
LOG_TAIL_LINES = 40


class ExitCode(enum.IntEnum):
    """What the launcher's exit status means."""

    OK = 0
    TRAINER_FAILED = 1
    SERVER_START_FAILED = 2
    SERVER_DIED = 3  # the last server died (or any, with launch.on_server_death=stop)
    BAD_CONFIG = 4
    INTERRUPTED = 130  # 128 + SIGINT
    TERMINATED = 143  # 128 + SIGTERM


class LaunchError(RuntimeError):
    """A launch step failed; `code` is the launcher's exit status for it."""

    def __init__(self, message: str, code: ExitCode):
        super().__init__(message)
        self.code = code


class Interrupted(Exception):
    """A SIGINT or SIGTERM reached the launcher."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_T0 = time.monotonic()


def log(msg: str) -> None:
    """Launcher messages go to stderr, prefixed (with seconds since start) to stand out."""
    print(f"[launcher {time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


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

    def any_alive(self) -> bool:
        if self.proc.poll() is None:
            return True
        return any(procs.is_alive(p) for p in self.descendants)


def tail(path: Path, n: int = LOG_TAIL_LINES) -> str:
    """The last `n` lines of a log file (empty if it does not exist)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


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
        self.echo = echo if echo is not None else sys.stdout
        self.servers: list[Child] = []
        self.trainer: Child | None = None
        self._signal: int | None = None
        self._wake = threading.Event()

    # -- signals ---------------------------------------------------------------------------

    def _on_signal(self, signum, _frame) -> None:
        if self._signal is None:
            self._signal = signum
        self._wake.set()

    def _check_signal(self) -> None:
        if self._signal is not None:
            raise Interrupted(self._signal)

    def _sleep(self, seconds: float) -> None:
        """Sleep, but wake at once on a signal."""
        self._wake.wait(seconds)
        self._check_signal()

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
        """The policy version the run starts from: the latest complete checkpoint's step when
        it will resume (`recover.mode`), else 0. The servers report it until the first push."""
        if self.cfg.recover.mode == "disabled":
            return 0
        found = complete_checkpoints(run_dir(self.cfg) / "checkpoints")
        return found[-1][0] if found else 0

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
            env = dict(os.environ)
            if gpu_plan[i] is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpu_plan[i]
            log_path = self.log_dir / f"server{i}.log"
            log_file = open(log_path, "ab", buffering=0)
            log_file.write(f"[launcher] {masked(cmd)}\n".encode())
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                env=env, start_new_session=True, preexec_fn=_child_setup(cpus[i]),
            )
            child = Child(f"server{i}", proc, log_path, log_file, addr=f"{host}:{port}")
            self.servers.append(child)
            pinned = f" on cores {cpus[i]}" if cpus[i] else ""
            log(f"started server{i} (pid {proc.pid}) on {child.addr}{pinned}; log: {log_path}")
        return [s.addr for s in self.servers]

    def _healthy(self, addr: str) -> bool:
        req = urllib.request.Request(f"http://{addr}/health")
        if self.cfg.server.api_key:
            req.add_header("Authorization", f"Bearer {self.cfg.server.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=2.0) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_servers(self) -> None:
        """Wait until every server answers /health, or fail with the log tail of the culprit."""
        timeout = self.cfg.launch.server_startup_timeout_s
        deadline = time.monotonic() + timeout
        pending = list(self.servers)
        while pending:
            for s in list(pending):
                code = s.proc.poll()
                if code is not None:
                    raise LaunchError(
                        f"{s.name} ({s.addr}) exited with code {code} before it was ready. "
                        f"Last lines of {s.log_path}:\n{tail(s.log_path)}",
                        ExitCode.SERVER_START_FAILED)
                if self._healthy(s.addr):
                    log(f"{s.name} at {s.addr} is healthy")
                    pending.remove(s)
            if not pending:
                break
            if time.monotonic() > deadline:
                s = pending[0]
                names = ", ".join(f"{p.name} ({p.addr})" for p in pending)
                raise LaunchError(
                    f"{names} did not answer /health within launch.server_startup_timeout_s="
                    f"{timeout:g}s (raise it for big models). Last lines of {s.log_path}:\n"
                    f"{tail(s.log_path)}", ExitCode.SERVER_START_FAILED)
            self._sleep(0.25)

    # -- trainer ---------------------------------------------------------------------------

    def trainer_command(self) -> list[str]:
        """`python -m torch.distributed.run --standalone ... SCRIPT --config CFG overrides`."""
        # A script path runs as a file; a dotted module name (the default, `arealite.train`) with -m.
        target = [self.script] if self.script.endswith(".py") else ["-m", self.script]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(self.cfg.launch.n_trainer_procs), *target]
        if self.config_path:
            cmd += ["--config", self.config_path]
        # The API key reaches the trainer in AREALITE_SERVER_API_KEY only: an override
        # carrying it would show in `ps` and in the logged command line.
        return cmd + [o for o in self.overrides if not o.startswith("server.api_key=")]

    def start_trainer(self, addrs: list[str]) -> Child:
        env = dict(os.environ)
        env.update(self.cfg.launch.trainer_env)
        env[ENV_SERVER_ADDRS] = ",".join(addrs)
        if self.cfg.server.api_key:
            env[ENV_SERVER_API_KEY] = self.cfg.server.api_key
        env["PYTHONUNBUFFERED"] = "1"
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
        """Wait for the trainer; stop early on a signal, or when servers die.

        A dying server is logged; the run goes on while another one lives (the
        trainer's client drops the dead one from rotation and weight updates),
        unless `launch.on_server_death` is `stop`. The last one dying stops the run.
        """
        assert self.trainer is not None
        ticks = 0
        dead: set[str] = set()
        while True:
            code = self.trainer.proc.poll()
            if code is not None:
                if self.trainer.pump is not None:
                    self.trainer.pump.join(timeout=5)
                if code == 0:
                    log("trainer finished" + (f" ({len(dead)} server(s) died on the way: "
                                              f"{', '.join(sorted(dead))})" if dead else ""))
                    return ExitCode.OK
                log(f"trainer failed with exit code {code}; see {self.trainer.log_path}")
                if self.servers and all(s.proc.poll() is not None for s in self.servers):
                    log("no inference server is alive: the run cannot go on")
                    return ExitCode.SERVER_DIED
                return ExitCode.TRAINER_FAILED
            for s in self.servers:
                if s.name in dead:
                    continue
                code = s.proc.poll()
                if code is None:
                    continue
                dead.add(s.name)
                left = [x for x in self.servers if x.name not in dead and x.proc.poll() is None]
                why = (f"{s.name} ({s.addr}, pid {s.pid}) died with exit code {code} while "
                       f"training. Last lines of {s.log_path}:\n{tail(s.log_path)}\n")
                if not left:
                    log(why + "No inference server is left: stopping the trainer")
                    return ExitCode.SERVER_DIED
                if self.cfg.launch.on_server_death == "stop":
                    log(why + "Stopping the trainer (launch.on_server_death=stop)")
                    return ExitCode.SERVER_DIED
                log(why + f"{len(left)} of {len(self.servers)} server(s) left "
                    f"({', '.join(x.name for x in left)}): the run goes on without {s.name}, "
                    "which the trainer drops from rotation and weight updates "
                    "(launch.on_server_death=continue)")
            # torchrun spawns its workers in their own sessions: keep a record of them so
            # that teardown reaches them even after torchrun itself is gone.
            if ticks % 5 == 0:
                self.trainer.remember_descendants()
            ticks += 1
            self._sleep(0.2)

    # -- teardown --------------------------------------------------------------------------

    def teardown(self) -> None:
        """SIGTERM every child (trainer first), SIGKILL what is left after the grace period."""
        children = ([self.trainer] if self.trainer else []) + self.servers
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
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {s: signal.signal(s, self._on_signal) for s in handled}
        try:
            if self.cfg.launch.n_servers > 0:
                addrs = self.start_servers()
                self.wait_servers()
            else:
                if not self.external_addrs:
                    raise LaunchError(
                        f"launch.n_servers=0 but no server addresses: set launch.server_addrs or "
                        f"{ENV_SERVER_ADDRS}=host:port,...", ExitCode.BAD_CONFIG)
                addrs = self.external_addrs
                log(f"using servers started elsewhere: {','.join(addrs)}")
            self._check_signal()
            self.start_trainer(addrs)
            return int(self.watch())
        except LaunchError as e:
            log(str(e))
            return int(e.code)
        except Interrupted as e:
            log(f"{e} received: shutting down")
            return int(ExitCode.INTERRUPTED if e.signum == signal.SIGINT else ExitCode.TERMINATED)
        finally:
            # A second Ctrl-C during teardown must not leave orphans behind: ignore it.
            for s in handled:
                signal.signal(s, signal.SIG_IGN)
            try:
                self.teardown()
                log("all children stopped")
            finally:
                for s, h in previous.items():
                    signal.signal(s, h)


#: What the launcher runs under torchrun when no script is given: the library trainer.
DEFAULT_ENTRY = "arealite.train"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # exit with our documented code for bad arguments
        self.print_usage(sys.stderr)
        self.exit(int(ExitCode.BAD_CONFIG), f"{self.prog}: error: {message}\n")


def parse_launcher_args(argv: Sequence[str]) -> argparse.Namespace:
    p = _Parser(prog="python -m arealite.launcher.local",
                description="Start inference servers, then run the trainer under torchrun: "
                            f"the library trainer (`{DEFAULT_ENTRY}`, the workflow named in the config) "
                            "unless a training script or module is given.",
                epilog="Exit codes: 0 ok, 1 trainer failed, 2 server failed to start, "
                       "3 server died, 4 bad arguments/config, 130 SIGINT, 143 SIGTERM.")
    p.add_argument("--config", default=None, help="YAML config file")
    p.add_argument("args", nargs="*", metavar="[SCRIPT|MODULE] OVERRIDES",
                   help="optional training script (path.py) or module (pkg.mod), run as `torchrun "
                        "SCRIPT --config CFG overrides`; then dotted overrides, e.g. actor.optimizer.lr=1e-5")
    args = p.parse_intermixed_args(list(argv))
    rest = list(args.args)
    args.script = DEFAULT_ENTRY
    if rest and "=" not in rest[0]:
        args.script = rest.pop(0)
    args.overrides = rest
    if args.script.endswith(".py"):
        if not Path(args.script).is_file():
            p.error(f"script {args.script!r} does not exist")
    elif not all(part.isidentifier() for part in args.script.split(".")):
        p.error(f"{args.script!r} is neither a script (path.py), a module (pkg.mod) nor an override (key=value)")
    elif not _module_exists(args.script):
        p.error(f"module {args.script!r} cannot be found (is its package installed or on PYTHONPATH?)")
    return args


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package is missing
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m arealite.launcher.local`; returns the exit code."""
    args = parse_launcher_args(sys.argv[1:] if argv is None else argv)
    from arealite.config.loader import check_launch, load_config
    from arealite.launcher.server_cmd import server_model_path

    try:
        cfg = load_config(args.config, args.overrides)
        external_addrs = check_launch(cfg)
        if cfg.launch.n_servers > 0:
            server_model_path(cfg)  # fail now, not inside a server, if no model is set
    except ValueError as e:  # ConfigError is a ValueError
        log(f"bad config: {e}")
        return int(ExitCode.BAD_CONFIG)
    log("config loaded")
    run_dir = Path(cfg.experiment.output_root) / cfg.experiment.name / cfg.experiment.trial
    return LocalLauncher(cfg, args.script, args.config, args.overrides, run_dir,
                         external_addrs=external_addrs).run()


if __name__ == "__main__":
    sys.exit(main())
