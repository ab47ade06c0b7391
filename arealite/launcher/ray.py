"""Run the same training on an existing Ray cluster: servers and trainer ranks in placement groups.

    ray start --head                       # once, on the head node (then `ray start --address ...` on the others)
    python -m arealite.launcher.ray [SCRIPT|MODULE] --config CFG [key=value ...]

1. Loads and validates the config; joins the cluster (`launch.ray.address`, `auto` by
   default) and checks that its nodes can hold the servers and trainer ranks at all
   (`launch.ray.*`); nothing starts otherwise (exit 5, naming the keys to change).
2. Reserves one placement group for the servers and one for the trainer ranks (one
   bundle each of `launch.ray.server_*` / `trainer_*` resources; with
   `launch.ray.separate_nodes` the trainer bundles avoid the servers' nodes).
3. In each bundle a `ProcessHost` actor starts its process: a server bound to its node's
   IP (`launch.cluster_bind`), or one trainer rank with the torch.distributed environment
   (RANK, WORLD_SIZE, MASTER_ADDR = rank 0's node IP, MASTER_PORT free there) instead of
   torchrun, the server addresses in AREALITE_SERVER_ADDRS, the API key in
   AREALITE_SERVER_API_KEY and the node's IP in AREALITE_HOST_IP (the address the
   weight-update group's store advertises).
4. Streams every process's output into `<run dir>/logs/` (`server<i>.log`, `trainer.log`
   for rank 0, which is also echoed, `trainer<r>.log` for the other ranks).
5. Watches as the local launcher does (`launch.on_server_death`; the same exit codes) and
   tears every process, actor and placement group down on success, failure, Ctrl-C or
   SIGTERM. Actors belong to this driver: if it is killed outright, Ray reaps them.

The training code is unchanged: a rank cannot tell Ray from torchrun. The run directory
(`experiment.output_root`) must be on a filesystem every node shares, as for checkpoints.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Sequence

from arealite.config.run import ENV_SERVER_ADDRS, ENV_SERVER_API_KEY
from arealite.launcher import placement
from arealite.launcher.common import (
    TERM_GRACE_S,
    ExitCode,
    LaunchError,
    SignalGuard,
    launch_main,
    log,
    server_env,
    start_version,
    trainer_args,
    wait_healthy,
    watch_run,
)
from arealite.launcher.process_host import PYTHON, ProcessHost
from arealite.server.command_line import masked, server_command
from arealite.utils.net import ENV_HOST_IP, split_addr

#: Driver environment passed on to every process (a node's own environment is kept otherwise).
FORWARDED_PREFIXES = ("AREALITE_", "SGLANG_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "TORCH_", "NCCL_",
                      "GLOO_", "WANDB_", "OMP_NUM_THREADS", "PYTHONPATH")
#: Set per process by the launcher, never copied from the driver.
_NOT_FORWARDED = (ENV_SERVER_ADDRS, ENV_SERVER_API_KEY, ENV_HOST_IP)
#: Seconds between two rounds of log copying and of watching.
PERIOD_S = 0.5
#: Read by Ray when it is imported: "0" makes it take loopback as this machine's IP. Without it
#: `ray.init` rewrites a loopback head address into the interface IP before dialling it
#: (ray-project/ray#59110), which a cluster started with `--node-ip-address=127.0.0.1` does not
#: listen on.
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k.startswith(FORWARDED_PREFIXES) and k not in _NOT_FORWARDED}


def resolve_address(address: str) -> str:
    """`launch.ray.address` as `host:port`: `auto` is RAY_ADDRESS, else the address `ray start`
    left in Ray's temp directory. Raises LaunchError naming the key when there is none."""
    if address != "auto":
        return address.removeprefix("ray://")
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env and env != "auto":
        return env.removeprefix("ray://")
    current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
    try:
        text = current.read_text().strip()
    except OSError:
        text = ""
    if not text:
        raise LaunchError(
            "no Ray cluster to join: launch.ray.address=auto found neither RAY_ADDRESS nor a cluster "
            "started on this machine; start one (`ray start --head`) or set launch.ray.address=host:port",
            ExitCode.CLUSTER_UNAVAILABLE)
    return text


def keep_loopback(address: str) -> None:
    """Make Ray dial a loopback head address as given (call before Ray is imported)."""
    host = split_addr(address)[0]
    if host != "localhost" and not host.startswith("127."):
        return
    if "ray" in sys.modules and os.environ.get(RAY_LOOPBACK_ENV) != "0":
        raise LaunchError(f"launch.ray.address={address} is a loopback address, but Ray was imported before "
                          f"the launcher could set {RAY_LOOPBACK_ENV}=0 (Ray would dial this machine's "
                          "interface IP instead); set it in the environment", ExitCode.CLUSTER_UNAVAILABLE)
    os.environ[RAY_LOOPBACK_ENV] = "0"


def check_reachable(address: str, timeout_s: float) -> None:
    """Fail fast when nothing listens at the head's address (ray.init would retry for minutes)."""
    try:
        host, port = split_addr(address)
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except (OSError, ValueError) as e:
        raise LaunchError(
            f"the Ray cluster at {address} cannot be reached ({e}): is it running (`ray status`)? "
            "Set launch.ray.address (or RAY_ADDRESS) to its head node's host:port, or raise "
            "launch.ray.connect_timeout_s", ExitCode.CLUSTER_UNAVAILABLE) from None


class RayProc:
    """The launcher's handle on one `ProcessHost` actor: polls it and copies its log home."""

    def __init__(self, name: str, actor, log_path: Path, echo: IO | None = None):
        self.name, self.actor, self.log_path, self.echo = name, actor, log_path, echo
        self.addr: str | None = None
        self.node_ip = self.node_id = ""
        self._offset = 0
        self._code: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        import ray

        if self._code is not None:
            return self._code
        try:
            self._code = ray.get(self.actor.poll.remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            log(f"{self.name}'s actor is lost ({type(e).__name__}): counted as exit code -1")
            self._code = -1
        return self._code

    def pump(self) -> None:
        """Append what the process wrote since the last call to its log in the run directory."""
        import ray

        with self._lock:
            while True:
                try:
                    chunk = ray.get(self.actor.read_log.remote(self._offset), timeout=30)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    return
                if not chunk:
                    return
                self._offset += len(chunk)
                with open(self.log_path, "ab") as f:
                    f.write(chunk)
                if self.echo is not None:
                    try:
                        self.echo.write(chunk.decode(errors="replace"))
                        self.echo.flush()
                    except (OSError, ValueError):  # console closed: keep logging to the file
                        pass


class RankGroup:
    """The trainer ranks watched as one: the first failure is the trainer's exit code."""

    name = "trainer"
    addr = None

    def __init__(self, ranks: list[RayProc]):
        self.ranks = ranks
        self.log_path = ranks[0].log_path

    def poll(self) -> int | None:
        codes = [r.poll() for r in self.ranks]
        failed = [(c, r) for c, r in zip(codes, self.ranks) if c not in (None, 0)]
        if failed:
            self.log_path = failed[0][1].log_path
            return failed[0][0]
        return 0 if all(c == 0 for c in codes) else None


class RayLauncher:
    """Places, starts, watches and always tears down a run on a Ray cluster."""

    def __init__(self, cfg, script: str, config_path: str | None, overrides: Sequence[str],
                 run_dir: Path, echo: IO | None = None, external_addrs: Sequence[str] = ()):
        self.cfg = cfg
        self.script, self.config_path, self.overrides = script, config_path, list(overrides)
        self.external_addrs = list(external_addrs)
        self.log_dir = run_dir / "logs"
        self.echo = echo if echo is not None else sys.stdout
        self.servers: list[RayProc] = []
        self.ranks: list[RayProc] = []
        self.groups: list = []
        self._signals = SignalGuard()
        self._pumping = threading.Event()
        self._pump_thread: threading.Thread | None = None

    # -- the cluster -----------------------------------------------------------------------

    def connect(self) -> None:
        """Join the cluster and check, before anything starts, that the roles fit on it."""
        r = self.cfg.launch.ray
        address = resolve_address(r.address)
        check_reachable(address, r.connect_timeout_s)
        keep_loopback(address)
        import ray

        env_vars = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}
        ray.init(address=address, namespace="arealite", log_to_driver=False, logging_level="WARNING",
                 runtime_env={"env_vars": env_vars} if env_vars else None)
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n.get("Alive")}
        log(f"joined the Ray cluster at {address}: {len(nodes)} node(s)")
        try:
            placement.check_fits(self.cfg, nodes)
        except ValueError as e:
            raise LaunchError(str(e), ExitCode.CLUSTER_UNAVAILABLE) from None

    def _reserve(self, role: placement.Role, avoid: list[str]):
        """A placement group for `role` (off the nodes in `avoid`), once the cluster grants it."""
        import ray
        from ray.util.placement_group import placement_group

        selector = ([{"ray.io/node-id": f"!in({','.join(avoid)})"}] * role.count) if avoid else None
        pg = placement_group([dict(role.bundle)] * role.count, strategy=self.cfg.launch.ray.placement_strategy,
                             bundle_label_selector=selector)
        self.groups.append(pg)
        timeout = self.cfg.launch.ray.placement_timeout_s
        ready = pg.ready()
        deadline = time.monotonic() + timeout
        while not ray.wait([ready], timeout=0.5)[0]:
            self._signals.check()
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"the Ray cluster did not grant {role.count} {role.name}(s) of {role.bundle} within "
                    f"launch.ray.placement_timeout_s={timeout:g}s (are other jobs holding the resources? "
                    f"`ray status` shows them); lower {role.keys} or raise the timeout",
                    ExitCode.CLUSTER_UNAVAILABLE)
        return pg

    def _actor(self, pg, index: int, bundle: dict, name: str, echo: IO | None = None) -> RayProc:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        extra = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        actor = ray.remote(ProcessHost).options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), resources=extra or None,
            max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=index)).remote(name)
        proc = RayProc(name, actor, self.log_dir / f"{name}.log", echo)
        proc.node_ip, proc.node_id = ray.get([actor.node_ip.remote(), actor.node_id.remote()])
        return proc

    def _start(self, proc: RayProc, cmd: list[str], env: dict[str, str]) -> None:
        import ray

        with open(proc.log_path, "ab") as f:
            f.write(f"[launcher] {masked(cmd)}\n".encode())
        pid = ray.get(proc.actor.start.remote(cmd, env, os.getcwd()))
        actor_pid = ray.get(proc.actor.pid.remote())
        where = f" on {proc.addr}" if proc.addr else ""
        log(f"started {proc.name} (pid {pid}, actor pid {actor_pid}, node {proc.node_id[:12]} at "
            f"{proc.node_ip}){where}; "
            f"log: {proc.log_path}")

    # -- servers and trainer ranks -----------------------------------------------------------

    def start_servers(self) -> list[str]:
        """One server per bundle, bound per `launch.cluster_bind`; returns their addresses."""
        import ray

        cfg = self.cfg
        role, _ = placement.roles(cfg)
        pg = self._reserve(role, avoid=[])
        version = start_version(cfg)
        for i in range(cfg.launch.n_servers):
            proc = self._actor(pg, i, role.bundle, f"server{i}")
            bind = proc.node_ip if cfg.launch.cluster_bind == "node_ip" else "0.0.0.0"
            port = cfg.server.base_port + i if cfg.server.base_port else ray.get(proc.actor.free_port.remote(bind))
            proc.addr = f"{proc.node_ip}:{port}"
            cmd = [PYTHON, *server_command(cfg, port, i, weight_version=version, host=bind)[1:]]
            self.servers.append(proc)
            self._start(proc, cmd, {**forwarded_env(), **server_env(cfg), ENV_HOST_IP: proc.node_ip})
        return [s.addr for s in self.servers]

    def _server_nodes(self) -> list[str]:
        from ray.util.placement_group import placement_group_table

        if not (self.cfg.launch.ray.separate_nodes and self.groups):
            return []
        return sorted(set(placement_group_table(self.groups[0])["bundles_to_node_id"].values()))

    def start_trainers(self, addrs: list[str]) -> None:
        """One trainer rank per bundle, with the environment torchrun would give it."""
        import ray

        cfg = self.cfg
        _, role = placement.roles(cfg)
        pg = self._reserve(role, avoid=self._server_nodes())
        n = cfg.launch.n_trainer_procs
        self.ranks = [self._actor(pg, r, role.bundle, "trainer" if r == 0 else f"trainer{r}",
                                  echo=self.echo if r == 0 else None) for r in range(n)]
        # Rank 0 serves the group's store on its node address alone (utils.dist.init_default_group).
        master_port = ray.get(self.ranks[0].actor.free_port.remote("0.0.0.0"))
        cmd = [PYTHON, *trainer_args(self.script, self.config_path, self.overrides)]
        base = {**forwarded_env(), **cfg.launch.trainer_env, ENV_SERVER_ADDRS: ",".join(addrs),
                "WORLD_SIZE": str(n), "MASTER_ADDR": self.ranks[0].node_ip, "MASTER_PORT": str(master_port),
                "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "PYTHONUNBUFFERED": "1"}
        if cfg.server.api_key:
            base[ENV_SERVER_API_KEY] = cfg.server.api_key
        for r, proc in enumerate(self.ranks):
            # Ray hands each rank its own GPU(s) in CUDA_VISIBLE_DEVICES: LOCAL_RANK 0 is its device.
            self._start(proc, cmd, {**base, "RANK": str(r), ENV_HOST_IP: proc.node_ip})
        log(f"trainer: {n} rank(s), rendezvous at {self.ranks[0].node_ip}:{master_port}")

    # -- logs, watching, teardown ------------------------------------------------------------

    def _pump_loop(self) -> None:
        while self._pumping.is_set():
            for p in self.servers + self.ranks:
                p.pump()
            time.sleep(PERIOD_S)

    def teardown(self) -> None:
        """Stop every process (trainer ranks first), copy the last logs, kill the actors and
        free the placement groups."""
        import ray

        if not ray.is_initialized():
            return
        self._pumping.clear()
        if self._pump_thread is not None:
            self._pump_thread.join(timeout=30)
        for group in (self.ranks, self.servers):
            stops = [p.actor.stop.remote(TERM_GRACE_S) for p in group]
            try:
                ray.get(stops, timeout=TERM_GRACE_S + 15)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass  # a lost actor took its process with it (it dies with its parent)
        for p in self.ranks + self.servers:
            p.pump()
            p.actor.cleanup.remote()
            ray.kill(p.actor, no_restart=True)
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups:
            remove_placement_group(pg)
        ray.shutdown()

    def _launch(self) -> int:
        if self.cfg.agent.judge.n_servers:
            raise LaunchError("agent.judge.n_servers: the Ray launcher does not start judge servers (the local "
                              "launcher does); start them on the cluster and set agent.judge.addrs",
                              ExitCode.BAD_CONFIG)
        self.connect()
        self._signals.check()
        self._pumping.set()
        self._pump_thread = threading.Thread(target=self._pump_loop, daemon=True, name="ray-logs")
        self._pump_thread.start()
        if self.cfg.launch.n_servers > 0:
            addrs = self.start_servers()
            wait_healthy(self.servers, self.cfg.launch.server_startup_timeout_s, self.cfg.server.api_key,
                         self._signals.sleep)
        else:
            addrs = self.external_addrs
            log(f"using servers started elsewhere: {','.join(addrs)}")
        self._signals.check()
        self.start_trainers(addrs)
        return int(watch_run(self.cfg, RankGroup(self.ranks), self.servers, self._signals.sleep,
                             period=PERIOD_S))

    def run(self) -> int:
        """Launch, watch and tear down; return the exit code (see `ExitCode`)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self._signals.run(self._launch, self.teardown)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m arealite.launcher.ray`; returns the exit code."""
    if importlib.util.find_spec("ray") is None:  # not imported: see `keep_loopback`
        log("the Ray launcher needs Ray: pip install 'arealite[ray]'")
        return int(ExitCode.BAD_CONFIG)
    return launch_main(argv, "python -m arealite.launcher.ray",
                       "Place inference servers and trainer ranks on a Ray cluster", RayLauncher)


if __name__ == "__main__":
    sys.exit(main())
