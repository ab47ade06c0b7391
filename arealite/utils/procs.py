"""Process-tree lookups through /proc (Linux): used to find and kill trainer workers in
fault-injection tests and the recovery benchmark."""

from __future__ import annotations

import os
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """PIDs of every living descendant of ``pid``."""
    kids: dict[int, list[int]] = {}
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                ppid = int(Path(f"/proc/{e}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(e))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def trainer_workers(launcher_pid: int, script: str = "examples/rlvr/train.py") -> list[int]:
    """The torchrun worker processes running ``script`` (not the torchrun agent) under a launcher."""
    out = []
    for pid in descendants(launcher_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if script in cmd and "torch.distributed.run" not in cmd:
            out.append(pid)
    return out
