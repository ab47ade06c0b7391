"""What every launcher shares: exit codes, messages, the command line, health probes,
the server-death policy and signal handling.

The local, Ray and Slurm launchers differ in where processes run and how they are
started; what a run means (start servers, wait for health, run the trainer, watch,
tear down) and how it is reported is the same, and lives here.
"""

from __future__ import annotations

import argparse
import enum
import importlib.util
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Protocol, Sequence

from arealite.config.run import ENV_SERVER_API_KEY, run_dir
from arealite.utils.checkpoint_manifest import complete_checkpoints

#: Seconds between SIGTERM and SIGKILL when tearing a child down.
TERM_GRACE_S = float(os.environ.get("AREALITE_LAUNCHER_GRACE_S", "10"))
#: Lines of a server's log shown when it fails.
LOG_TAIL_LINES = 40
#: What the launchers run as trainer when no script is given: the library trainer.
DEFAULT_ENTRY = "arealite.train"


class ExitCode(enum.IntEnum):
    """What a launcher's exit status means."""

    OK = 0
    TRAINER_FAILED = 1
    SERVER_START_FAILED = 2
    SERVER_DIED = 3  # the last server died (or any, with launch.on_server_death=stop)
    BAD_CONFIG = 4
    CLUSTER_UNAVAILABLE = 5  # no cluster reachable, or too small for the placement
    INTERRUPTED = 130  # 128 + SIGINT
    TERMINATED = 143  # 128 + SIGTERM


EXIT_CODES_HELP = ("Exit codes: 0 ok, 1 trainer failed, 2 server failed to start, 3 server died, "
                   "4 bad arguments/config, 5 cluster unreachable or too small, 130 SIGINT, 143 SIGTERM.")


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


def tail(path: Path, n: int = LOG_TAIL_LINES) -> str:
    """The last `n` lines of a log file (empty if it does not exist)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def start_version(cfg) -> int:
    """The policy version the run starts from: the latest complete checkpoint's step when
    it will resume (`recover.mode`), else 0. The servers report it until the first push."""
    if cfg.recover.mode == "disabled":
        return 0
    found = complete_checkpoints(run_dir(cfg) / "checkpoints")
    return found[-1][0] if found else 0


def server_env(cfg) -> dict[str, str]:
    """Environment a server needs from the launcher: the API key, which never goes on a
    command line (it would show in `ps` and in the logged command)."""
    return {ENV_SERVER_API_KEY: cfg.server.api_key} if cfg.server.api_key else {}


def healthy(addr: str, api_key: str | None, timeout: float = 2.0) -> bool:
    """Whether the server at `addr` answers `/health` with 200."""
    req = urllib.request.Request(f"http://{addr}/health")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


# -- the trainer's command line ------------------------------------------------------------


def trainer_target(script: str) -> list[str]:
    """A script path runs as a file; a dotted module name (e.g. `arealite.train`) with -m."""
    return [script] if script.endswith(".py") else ["-m", script]


def trainer_args(script: str, config_path: str | None, overrides: Sequence[str]) -> list[str]:
    """`SCRIPT --config CFG overrides`, without the API key override.

    The key reaches the trainer in AREALITE_SERVER_API_KEY only: an override carrying it
    would show in `ps` and in the logged command line."""
    out = trainer_target(script)
    if config_path:
        out += ["--config", config_path]
    return out + [o for o in overrides if not o.startswith("server.api_key=")]


# -- watching a run ------------------------------------------------------------------------


class Watched(Protocol):
    """A process (or group of processes) a launcher watches."""

    name: str
    addr: str | None
    log_path: Path

    def poll(self) -> int | None:
        """Its exit code, or None while it runs."""


def server_died(cfg, dead: Watched, code: int, servers: Sequence[Watched],
                dead_names: set[str]) -> ExitCode | None:
    """Apply `launch.on_server_death` to a server found dead; returns the exit code to
    stop with, or None to go on. `dead_names` must already hold `dead.name`."""
    left = [s for s in servers if s.name not in dead_names and s.poll() is None]
    why = (f"{dead.name} ({dead.addr}) died with exit code {code} while training. "
           f"Last lines of {dead.log_path}:\n{tail(dead.log_path)}\n")
    if not left:
        log(why + "No inference server is left: stopping the trainer")
        return ExitCode.SERVER_DIED
    if cfg.launch.on_server_death == "stop":
        log(why + "Stopping the trainer (launch.on_server_death=stop)")
        return ExitCode.SERVER_DIED
    log(why + f"{len(left)} of {len(servers)} server(s) left "
        f"({', '.join(x.name for x in left)}): the run goes on without {dead.name}, "
        "which the trainer drops from rotation and weight updates "
        "(launch.on_server_death=continue)")
    return None


def trainer_finished(code: int, trainer: Watched, servers: Sequence[Watched], dead: set[str]) -> ExitCode:
    """The run's exit code once the trainer has exited with `code`."""
    if code == 0:
        log("trainer finished" + (f" ({len(dead)} server(s) died on the way: "
                                  f"{', '.join(sorted(dead))})" if dead else ""))
        return ExitCode.OK
    log(f"trainer failed with exit code {code}; see {trainer.log_path}")
    if servers and all(s.poll() is not None for s in servers):
        log("no inference server is alive: the run cannot go on")
        return ExitCode.SERVER_DIED
    return ExitCode.TRAINER_FAILED


def watch_run(cfg, trainer: Watched, servers: Sequence[Watched], sleep: Callable[[float], None],
              period: float = 0.2, tick: Callable[[int], None] | None = None) -> ExitCode:
    """Wait for the trainer; stop early when servers die (`launch.on_server_death`).

    A dying server is logged; the run goes on while another one lives (the trainer's
    client drops the dead one from rotation and weight updates), unless the policy is
    `stop`. The last one dying stops the run. `tick(i)` runs once per round."""
    dead: set[str] = set()
    i = 0
    while True:
        code = trainer.poll()
        if code is not None:
            return trainer_finished(code, trainer, servers, dead)
        for s in servers:
            if s.name in dead or (code := s.poll()) is None:
                continue
            dead.add(s.name)
            stop = server_died(cfg, s, code, servers, dead)
            if stop is not None:
                return stop
        if tick is not None:
            tick(i)
        i += 1
        sleep(period)


def wait_healthy(servers: Sequence[Watched], timeout: float, api_key: str | None,
                 sleep: Callable[[float], None]) -> None:
    """Wait until every server answers /health, or fail with the log tail of the culprit."""
    deadline = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        for s in list(pending):
            code = s.poll()
            if code is not None:
                raise LaunchError(
                    f"{s.name} ({s.addr}) exited with code {code} before it was ready. "
                    f"Last lines of {s.log_path}:\n{tail(s.log_path)}",
                    ExitCode.SERVER_START_FAILED)
            if s.addr and healthy(s.addr, api_key):
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
        sleep(0.25)


# -- signals ---------------------------------------------------------------------------------


class SignalGuard:
    """Turns SIGINT/SIGTERM into `Interrupted` at the launcher's next check or sleep."""

    HANDLED = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self._wake = threading.Event()
        self._previous: dict = {}

    def _on_signal(self, signum, _frame) -> None:
        if self.signum is None:
            self.signum = signum
        self._wake.set()

    def check(self) -> None:
        if self.signum is not None:
            raise Interrupted(self.signum)

    def sleep(self, seconds: float) -> None:
        """Sleep, but wake at once on a signal."""
        self._wake.wait(seconds)
        self.check()

    def run(self, body: Callable[[], int], teardown: Callable[[], None]) -> int:
        """Run `body` with the handlers installed, then `teardown` whatever happened;
        returns the exit code (a `LaunchError`'s code, 130/143 on a signal)."""
        self._previous = {s: signal.signal(s, self._on_signal) for s in self.HANDLED}
        try:
            return body()
        except LaunchError as e:
            log(str(e))
            return int(e.code)
        except Interrupted as e:
            log(f"{e} received: shutting down")
            return int(ExitCode.INTERRUPTED if e.signum == signal.SIGINT else ExitCode.TERMINATED)
        finally:
            # A second Ctrl-C during teardown must not leave orphans behind: ignore it.
            for s in self.HANDLED:
                signal.signal(s, signal.SIG_IGN)
            try:
                teardown()
                log("all children stopped")
            finally:
                for s, h in self._previous.items():
                    signal.signal(s, h)


# -- the command line ----------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # exit with our documented code for bad arguments
        self.print_usage(sys.stderr)
        self.exit(int(ExitCode.BAD_CONFIG), f"{self.prog}: error: {message}\n")


def parse_launcher_args(argv: Sequence[str], prog: str = "python -m arealite.launcher.local",
                        what: str = "Start inference servers, then run the trainer under torchrun",
                        add_options: Callable[[argparse.ArgumentParser], None] | None = None,
                        ) -> argparse.Namespace:
    """`[SCRIPT|MODULE] --config CFG [overrides]` of every launcher."""
    p = _Parser(prog=prog,
                description=f"{what}: the library trainer (`{DEFAULT_ENTRY}`, the workflow named in the "
                            "config) unless a training script or module is given.",
                epilog=EXIT_CODES_HELP)
    p.add_argument("--config", default=None, help="YAML config file")
    if add_options is not None:
        add_options(p)
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


def load_checked_config(args: argparse.Namespace):
    """The validated config of a launch (names included: `arealite.check`) and the external server
    addresses (`check_launch`); raises ValueError (a `ConfigError`) naming the field when something
    is wrong."""
    from arealite.check import load_run_config
    from arealite.config.launch_checks import check_launch
    from arealite.server.command_line import check_sim_backend, server_model_path

    cfg = load_run_config(args.config, args.overrides)
    external_addrs = check_launch(cfg)
    check_sim_backend(cfg)
    if cfg.launch.n_servers > 0:
        server_model_path(cfg)  # fail now, not inside a server, if no model is set
    return cfg, external_addrs


def launch_main(argv: Sequence[str] | None, prog: str, what: str, launcher_cls) -> int:
    """The `main` of a launcher that runs the whole job itself (local, Ray): arguments, the
    checked config (exit 4 naming the field), then `launcher_cls(...).run()`."""
    args = parse_launcher_args(sys.argv[1:] if argv is None else argv, prog=prog, what=what)
    try:
        cfg, external_addrs = load_checked_config(args)
    except ValueError as e:  # ConfigError is a ValueError
        log(f"bad config: {e}")
        return int(ExitCode.BAD_CONFIG)
    log("config loaded")
    return launcher_cls(cfg, args.script, args.config, args.overrides, run_dir(cfg),
                        external_addrs=external_addrs).run()
