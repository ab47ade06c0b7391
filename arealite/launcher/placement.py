"""Placement of a run's roles on cluster nodes: the bundles each role asks for, and a
check, before anything starts, that the cluster can hold them at all.

Pure functions of the config and of the nodes' total resources (what `ray.nodes()`
reports), so that a run too big for its cluster fails at once with the config keys
to change, rather than waiting for a placement group that can never be granted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from arealite.server.command_line import gpus_per_server

Resources = dict[str, float]


@dataclass
class Role:
    """`count` bundles of `bundle` resources, described by the config keys that set them."""

    name: str
    count: int
    bundle: Resources
    keys: str
    nodes_used: set[str] = field(default_factory=set)


def roles(cfg) -> tuple[Role, Role]:
    """The servers' and the trainer ranks' bundles (`launch.ray.*`)."""
    r = cfg.launch.ray
    server_gpus = r.server_gpus
    if server_gpus is None:
        server_gpus = gpus_per_server(cfg) if cfg.launch.server_backend == "sglang" else 0
    server = {"CPU": r.server_cpus, "GPU": server_gpus, **r.server_resources}
    trainer = {"CPU": r.trainer_cpus, "GPU": r.trainer_gpus, **r.trainer_resources}
    server = {k: v for k, v in server.items() if v > 0}
    trainer = {k: v for k, v in trainer.items() if v > 0}
    return (Role("server", cfg.launch.n_servers, server,
                 "launch.n_servers, launch.ray.server_cpus/server_gpus/server_resources"),
            Role("trainer rank", cfg.launch.n_trainer_procs, trainer,
                 "launch.n_trainer_procs, launch.ray.trainer_cpus/trainer_gpus/trainer_resources"))


def _fits(bundle: Resources, free: Resources) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items())


def _take(bundle: Resources, free: Resources) -> None:
    for k, v in bundle.items():
        free[k] = free.get(k, 0.0) - v


def _place(role: Role, free: dict[str, Resources], strategy: str, banned: set[str]) -> str | None:
    """Take `role`'s bundles out of `free` (node id -> resources); None, or why it cannot."""
    nodes = [n for n in free if n not in banned]
    if strategy == "STRICT_PACK":
        total = {k: v * role.count for k, v in role.bundle.items()}
        node = next((n for n in nodes if _fits(total, free[n])), None)
        if node is None:
            return f"no single node holds all {role.count} {role.name}(s) (STRICT_PACK)"
        _take(total, free[node])
        role.nodes_used.add(node)
        return None
    for i in range(role.count):
        # STRICT_SPREAD: every bundle on its own node.
        candidates = [n for n in nodes if not (strategy == "STRICT_SPREAD" and n in role.nodes_used)]
        node = next((n for n in candidates if _fits(role.bundle, free[n])), None)
        if node is None:
            return f"only {i} of {role.count} {role.name}(s) fit"
        _take(role.bundle, free[node])
        role.nodes_used.add(node)
    return None


def _show(res: Resources) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(res.items())
                           if not k.startswith("node:") and k not in ("memory", "object_store_memory")) + "}"


def check_fits(cfg, nodes: dict[str, Resources]) -> None:
    """Raise ValueError naming the config keys if the servers and trainer ranks cannot be
    placed on `nodes` (node id -> total resources) at all."""
    server, trainer = roles(cfg)
    strategy = cfg.launch.ray.placement_strategy
    free = {n: dict(res) for n, res in nodes.items()}
    shown = "; ".join(f"node {n[:8]} {_show(res)}" for n, res in nodes.items()) or "no node"
    for role, banned in ((server, set()), (trainer, None)):
        if banned is None:
            banned = server.nodes_used if cfg.launch.ray.separate_nodes else set()
        if role.count == 0:
            continue
        why = _place(role, free, strategy, banned)
        if why is not None:
            apart = (" on nodes without a server (launch.ray.separate_nodes=true)"
                     if role is trainer and banned else "")
            raise ValueError(
                f"the Ray cluster cannot hold {role.count} {role.name}(s) of {_show(role.bundle)} each"
                f"{apart}: {why} (launch.ray.placement_strategy={strategy}). The cluster has: {shown}. "
                f"Lower {role.keys}, or add nodes")
