"""Process-tree lookups through /proc, a child dying with its parent, and the processes a
run's process starts itself, told to the launcher (Linux; no-ops elsewhere).

The one place arealite reads /proc for processes: the local launcher finds and
signals the processes below its children with it, and fault-injection tests and
the recovery benchmark find trainer workers to kill.
"""

from __future__ import annotations

import ctypes
import os
import signal


def _stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None if gone.

    The command name (field 2) may hold spaces and parentheses; the fields after its
    last ``)`` are fixed.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[int]:
    """PIDs of every living descendant of ``pid``, parents before their children."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    kids: dict[int, list[int]] = {}
    for e in entries:
        if not e.isdigit():
            continue
        fields = _stat_fields(e)
        if fields is None or len(fields) < 2:
            continue
        kids.setdefault(int(fields[1]), []).append(int(e))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _stat_fields(pid)
    # Without /proc, kill(0) is all we know.
    return fields is None or fields[0] != b"Z"


def cmdline(pid: int) -> str | None:
    """The command line of ``pid``, its arguments joined by spaces (None if gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


#: What the command line of a torchrun agent (not a worker) holds: torch's module, or the
#: launcher's (`arealite.launcher.torchrun`).
TORCHRUN_AGENTS = ("torch.distributed.run", "arealite.launcher.torchrun")


def trainer_workers(launcher_pid: int, script: str = "examples/rlvr/train.py") -> list[int]:
    """The torchrun worker processes running ``script`` (not the torchrun agent) under a launcher."""
    out = []
    for pid in descendants(launcher_pid):
        cmd = cmdline(pid)
        if cmd is not None and script in cmd and not any(agent in cmd for agent in TORCHRUN_AGENTS):
            out.append(pid)
    return out


#: The directory where a process of the run records the long-lived processes it starts
#: itself (`register_child`); the local launcher sets it, lists them and stops them with the
#: children it started.
ENV_CHILDREN_DIR = "AREALITE_CHILDREN_DIR"


def start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot; None if gone): with the pid, names one
    process for good, as a recycled pid starts later. Set at fork, unchanged by exec."""
    fields = _stat_fields(pid)
    return fields[19].decode() if fields is not None and len(fields) > 19 else None


def register_child(name: str, pid: int) -> None:
    """Tell the launcher (if one set ``AREALITE_CHILDREN_DIR``) of a process this one started:
    a file ``<name>.<pid>`` holding its `start_time`, by which the launcher knows the pid is
    still that process."""
    where = os.environ.get(ENV_CHILDREN_DIR)
    started = start_time(pid)
    if where and started is not None:
        with open(os.path.join(where, f"{name}.{pid}"), "w") as f:
            f.write(started)


def registered_children(where: str | os.PathLike) -> list[tuple[str, int]]:
    """(name, pid) of every process recorded in ``where`` by `register_child` that still runs
    (a recycled pid, started later, is left out), in the order recorded."""
    try:
        entries = sorted(os.scandir(where), key=lambda e: e.stat().st_mtime_ns)
    except OSError:
        return []
    out = []
    for e in entries:
        name, _, pid = e.name.rpartition(".")
        if not (name and pid.isdigit()):
            continue
        try:
            with open(e.path) as f:
                recorded = f.read()
        except OSError:
            continue
        if is_alive(int(pid)) and start_time(int(pid)) == recorded:
            out.append((name, int(pid)))
    return out


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when its parent dies, however it dies
    (a no-op elsewhere: process-group teardown still applies)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, sig)
    except OSError:
        pass
