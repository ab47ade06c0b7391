"""Run untrusted Python (a tool call, generated code and its unit tests) in a contained subprocess.

Every run gets a private temporary directory (its working directory, removed afterwards)
and these limits (`arealite.config.agent.SandboxConfig`):

- CPU seconds (``RLIMIT_CPU``), wall-clock seconds (the whole process tree is killed),
  address space (``RLIMIT_AS``), size of any file written (``RLIMIT_FSIZE``), number of
  processes (``RLIMIT_NPROC``), bytes of stdout/stderr kept (the rest is read and dropped).

When this process is root (or may create user namespaces), the run is also isolated:

- a private mount namespace in which every mount but the run's directory is read-only
  (no writes outside the directory; ``/tmp`` and ``/dev/shm`` included), and the Python
  installation is bind-mounted read-only beside the directory;
- a private network namespace with no interfaces but a down loopback (no network),
  unless ``network`` is allowed;
- as root, a user id of its own (one of 61000-61999, never two runs at once), so that
  ``RLIMIT_NPROC`` counts only this run's processes, it cannot signal the trainer, and
  every process it left behind is found and killed by that id.

What it does not isolate: reads (the code may read any file the trainer's user can
read), CPU and memory bandwidth shared with the machine, and the kernel itself. Without
root or user namespaces only the resource limits and the process-group kill apply.
`isolation()` says which mode this machine gets.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from arealite.config.agent import SandboxConfig

__all__ = ["SandboxResult", "isolation", "run_python", "arun_python"]

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWNET, _CLONE_NEWIPC = 0x00020000, 0x10000000, 0x40000000, 0x08000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_PR_SET_NO_NEW_PRIVS = 38
_UID_BASE, _UID_COUNT = 61000, 1000
_SKIP_MOUNTS = ("/proc", "/sys", "/dev/pts")


@dataclass
class SandboxResult:
    """How a sandboxed run ended."""

    returncode: int | None  # None: killed by the wall-clock limit
    stdout: str
    stderr: str
    timed_out: bool = False
    output_truncated: bool = False
    duration_s: float = 0.0
    signal: str | None = None  # e.g. SIGKILL (memory), SIGXCPU (CPU time), SIGXFSZ (file size)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@dataclass
class _Limits:
    cpu_s: float = 10.0
    wall_s: float = 20.0
    memory_mb: int = 1024
    file_size_mb: int = 16
    max_processes: int = 32
    max_output_bytes: int = 65536
    network: bool = False


def _limits(config: SandboxConfig | _Limits | None) -> _Limits:
    if config is None:
        return _Limits()
    return _Limits(**{k: getattr(config, k) for k in _Limits.__dataclass_fields__})


_libc = ctypes.CDLL(None, use_errno=True)
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()
_uid_counter = itertools.count()
_mode: str | None = None  # "namespaces-root" | "namespaces" | "rlimits", found on first use


def _take_uid() -> int:
    with _uid_lock:
        for _ in range(_UID_COUNT):
            uid = _UID_BASE + next(_uid_counter) % _UID_COUNT
            if uid not in _uids_in_use:
                _uids_in_use.add(uid)
                return uid
    raise RuntimeError(f"more than {_UID_COUNT} sandboxed runs at once")


def _give_uid(uid: int) -> None:
    with _uid_lock:
        _uids_in_use.discard(uid)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount_points() -> list[tuple[str, int]]:
    """(mount point, flags to keep) of every mount of this process, parents first."""
    keep = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC}
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            point = parts[4].encode().decode("unicode_escape")
            flags = sum(keep.get(opt, 0) for opt in parts[5].split(","))
            out.append((point, flags))
    return out


def _remount_readonly(point: str, flags: int) -> int:
    return _libc.mount(None, point.encode(), None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags, None)


def _child_setup(mode: str, lim: _Limits, box: str, pydir: str, prefix: str, uid: int,
                 mounts: list[tuple[str, int]]):
    """The function run in the child between fork and exec (namespaces, limits, identity)."""
    import resource

    def setup() -> None:
        if mode != "rlimits":
            flags = _CLONE_NEWNS | _CLONE_NEWIPC | (0 if lim.network else _CLONE_NEWNET)
            if mode == "namespaces":
                flags |= _CLONE_NEWUSER
            _check(_libc.unshare(flags), "unshare")
            _check(_libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
            _check(_libc.mount(box.encode(), box.encode(), None, _MS_BIND, None), "bind the run directory")
            _check(_libc.mount(prefix.encode(), pydir.encode(), None, _MS_BIND | _MS_REC, None), "bind python")
            _check(_remount_readonly(pydir, 0), "python read-only")
            for point, keep in mounts:
                rc = _remount_readonly(point, keep)
                if point == "/" or point.startswith("/tmp") or point.startswith("/dev/shm"):
                    _check(rc, f"remount {point} read-only")
            os.chdir(box)  # the working directory must be the new (writable) mount, not the one below it
        mem = lim.memory_mb * 2**20
        cpu = max(1, int(lim.cpu_s + 0.999))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim.file_size_mb * 2**20,) * 2)
        resource.setrlimit(resource.RLIMIT_NPROC, (lim.max_processes,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if mode == "namespaces-root":
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)

    return setup


def isolation() -> str:
    """``namespaces-root`` (own uid, read-only mounts, no network), ``namespaces`` (same
    without the own uid: user namespaces, not root) or ``rlimits`` (limits only)."""
    global _mode
    if _mode is None:
        candidates = (["namespaces-root"] if os.geteuid() == 0 else []) + ["namespaces", "rlimits"]
        for mode in candidates:
            _mode = mode
            try:
                res = run_python("print('ok')", _Limits(wall_s=20, cpu_s=10), _probe=True)
            except (OSError, subprocess.SubprocessError):
                continue
            if res.ok and res.stdout.strip() == "ok":
                break
        else:
            _mode = "rlimits"
    return _mode


def run_python(code: str, limits: SandboxConfig | _Limits | None = None, *, stdin: str = "", files: dict[str, str] | None = None,
               _probe: bool = False) -> SandboxResult:
    """Run ``code`` with ``python`` in a fresh sandbox; ``files`` are written to its directory first.

    ``limits``: a `SandboxConfig` (or anything with its fields; None = the defaults).
    Blocking: call it from a thread (a reward function) or use `arun_python`.
    """
    lim = _limits(limits)
    mode = _mode if _probe else isolation()
    root = tempfile.mkdtemp(prefix="arealite-sandbox-")
    uid = _take_uid() if mode == "namespaces-root" else -1
    try:
        return _run_in(root, mode, lim, code, stdin, files or {}, uid)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if uid >= 0:
            _give_uid(uid)


def _prepare(root: str, mode: str, code: str, files: dict[str, str], uid: int) -> tuple[str, str, str, list[str]]:
    box, pydir = os.path.join(root, "box"), os.path.join(root, "python")
    os.makedirs(box)
    os.makedirs(pydir)
    for name, text in {**files, "main.py": code}.items():
        path = os.path.normpath(os.path.join(box, name))
        if not path.startswith(box + os.sep):
            raise ValueError(f"sandbox file name {name!r} leaves the run directory")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    prefix = os.path.realpath(sys.base_prefix)
    exe = os.path.realpath(sys.executable)
    if mode == "rlimits" or not exe.startswith(prefix + os.sep):
        return box, pydir, prefix, [exe]
    os.chmod(root, 0o711)
    if uid >= 0:
        for dirpath, _, names in os.walk(box):
            os.chown(dirpath, uid, uid)
            for n in names:
                os.chown(os.path.join(dirpath, n), uid, uid)
    return box, pydir, prefix, [os.path.join(pydir, os.path.relpath(exe, prefix))]


def _run_in(root: str, mode: str, lim: _Limits, code: str, stdin: str, files: dict[str, str],
            uid: int) -> SandboxResult:
    box, pydir, prefix, exe = _prepare(root, mode, code, files, uid)
    env = {"PATH": "/usr/bin:/bin", "HOME": box, "TMPDIR": box, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
    if exe[0].startswith(pydir):
        env["LD_LIBRARY_PATH"] = os.path.join(pydir, "lib")
    mounts = [m for m in _mount_points() if m[0] not in _SKIP_MOUNTS and m[0] != root
              and not m[0].startswith(root + os.sep)] if mode != "rlimits" else []
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [*exe, "-E", "-s", "-u", "-B", "main.py"], cwd=box, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True,
        preexec_fn=_child_setup(mode, lim, box, pydir, prefix, uid, mounts),
    )
    try:
        out, err, truncated, timed_out = _collect(proc, stdin.encode(), lim, t0)
    finally:
        _kill_tree(proc, uid)
    rc = None if timed_out else proc.returncode
    return SandboxResult(rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), timed_out,
                         truncated, time.monotonic() - t0, _signal_name(rc))


def _signal_name(rc: int | None) -> str | None:
    """The name of the signal that killed the program (a negative return code), if it has one."""
    if rc is None or rc >= 0:
        return None
    try:
        return signal.Signals(-rc).name
    except ValueError:  # a signal number without a name (a real-time signal, say)
        return None


def _collect(proc: subprocess.Popen, stdin: bytes, lim: _Limits, t0: float) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout and stderr (keeping ``max_output_bytes`` of each) until both close or time is up."""
    try:
        if stdin:
            proc.stdin.write(stdin[: 1 << 20])
        proc.stdin.close()
    except OSError:  # the program exited without reading it
        pass
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    truncated = timed_out = False
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = lim.wall_s - (time.monotonic() - t0)
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(min(left, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = bufs[key.fd]
                room = lim.max_output_bytes - len(buf)
                if len(chunk) > room:
                    truncated = True
                buf += chunk[: max(room, 0)]
            if proc.poll() is not None and time.monotonic() - t0 > lim.wall_s:
                break
    if not timed_out:
        try:
            proc.wait(max(0.1, lim.wall_s - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            timed_out = True
    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), truncated, timed_out


def _uid_pids(uid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    pids.append(int(name))
            except OSError:
                pass
    return pids


def _kill_tree(proc: subprocess.Popen, uid: int) -> None:
    """SIGKILL the run's process group and, with an own uid, every process left under that uid."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid >= 0:
        for _ in range(100):  # a fork bomb keeps forking while we kill: RLIMIT_NPROC bounds it
            pids = _uid_pids(uid)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


async def arun_python(code: str, limits: SandboxConfig | None = None, *, stdin: str = "",
                      files: dict[str, str] | None = None) -> SandboxResult:
    """`run_python` in a worker thread, for use on an event loop (an agent's tool)."""
    import asyncio

    return await asyncio.to_thread(run_python, code, limits, stdin=stdin, files=files)
