"""Small network helpers: free ports and this host's address.

A port found free here can still be taken by someone else before it is bound;
the callers that care (the launcher) detect a server that failed to start and
report it, rather than pretending the race cannot happen.
"""

from __future__ import annotations

import os
import socket
from contextlib import ExitStack


def free_port(host: str = "127.0.0.1") -> int:
    """Return one TCP port that is free on `host` right now."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """Return `n` distinct TCP ports that are free on `host` right now.

    All sockets stay open until every port is picked, so the kernel cannot hand
    the same port out twice within one call.
    """
    if n < 0:
        raise ValueError(f"free_ports: n must be >= 0, got {n}")
    with ExitStack() as stack:
        ports = []
        for _ in range(n):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            ports.append(s.getsockname()[1])
        return ports


def ports_from(base: int, n: int, host: str = "127.0.0.1") -> list[int]:
    """Return `n` free ports at or above `base` (each one checked by binding it)."""
    if not 0 < base <= 65535:
        raise ValueError(f"ports_from: base port must be in 1..65535, got {base}")
    ports: list[int] = []
    port = base
    while len(ports) < n:
        if port > 65535:
            raise RuntimeError(f"no {n} free ports at or above {base} on {host}")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                port += 1
                continue
        ports.append(port)
        port += 1
    return ports


#: Set by the cluster launchers to the node's IP (Ray's view of it): wins over the guess below.
ENV_HOST_IP = "AREALITE_HOST_IP"


def host_ip() -> str:
    """This machine's address as other hosts see it (falls back to 127.0.0.1).

    ``AREALITE_HOST_IP`` when set (the Ray and Slurm launchers set it to the node's
    IP). Otherwise a UDP `connect`, which sends nothing; it only makes the kernel
    choose the outgoing interface, whose address is what peers should dial.
    """
    if os.environ.get(ENV_HOST_IP):
        return os.environ[ENV_HOST_IP]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            addr = s.getsockname()[0]
        if addr and not addr.startswith("0."):
            return addr
    except OSError:
        pass
    return "127.0.0.1"


def split_addr(addr: str) -> tuple[str, int]:
    """Parse `host:port` (an `http://` prefix is allowed) into `(host, port)`."""
    text = addr.strip()
    for prefix in ("http://", "https://"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    text = text.rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"bad server address {addr!r}: expected host:port, e.g. 127.0.0.1:30000")
    return host, int(port)


def is_local_host(host: str) -> bool:
    """Whether `host` names this machine (loopback, its hostname or its outgoing address)."""
    h = host.strip("[]").lower()
    if h in ("localhost", "::1", "0.0.0.0") or h.startswith("127."):
        return True
    # No DNS lookup: a config check must not hang on an unreachable resolver.
    return h in (socket.gethostname().lower(), host_ip())
