"""The admin fan-out's own thread (`arealite.inference_client.control_plane`): a weight update's
calls reach every server while the rollout loop is busy, and their CPU clock is theirs alone."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request

import pytest

from arealite.inference_client.errors import ServerAdminError
from arealite.inference_client.server_pool import ServerPool
from arealite.inference_client.sglang_admin import SGLangAdmin
from arealite.inference_client.sglang_wire import SGLangWire
from arealite.rollout.loop_thread import LoopThread

# Keep-alive HTTP/1.1 servers in a process of their own (so that they answer while this
# process's threads are busy): each notes when it answered an admin call; GET /calls lists them.
SERVERS = r"""
import json, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
calls = []
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def reply(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        calls.append([self.server.server_address[1], self.path, time.time()])
        if self.path == "/refuse":
            self.reply(400, {"error": {"message": "not while paused"}})
        else:
            self.reply(200, {"success": True})
    def do_GET(self):
        self.reply(200, calls)
servers = [ThreadingHTTPServer(("127.0.0.1", 0), H) for _ in range(int(sys.argv[1]))]
for s in servers:
    threading.Thread(target=s.serve_forever, daemon=True).start()
print(" ".join(str(s.server_address[1]) for s in servers), flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def servers():
    proc = subprocess.Popen([sys.executable, "-c", SERVERS, "8"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        ports = proc.stdout.readline().split()
        assert len(ports) == 8, "the test servers did not start"
        yield [f"127.0.0.1:{p}" for p in ports]
    finally:
        proc.stdin.close()
        proc.wait(10)


def answered_at(addr: str, route: str) -> list[float]:
    with urllib.request.urlopen(f"http://{addr}/calls", timeout=5) as r:
        port = int(addr.rpartition(":")[2])
        return [t for p, path, t in json.loads(r.read()) if p == port and path == route]


def burn(seconds: float) -> None:
    """A long rollout callback: CPU on the calling thread for ``seconds``."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.fixture
def rollout():
    lt = LoopThread("test-rollout")
    lt.start()
    yield lt
    lt.stop(lambda: asyncio.sleep(0), 10)


def test_admin_calls_reach_every_server_while_the_rollout_loop_is_blocked(servers, rollout):
    async def scenario():
        pool = ServerPool(servers, wire=SGLangWire(), max_inflight=4, request_timeout_s=10)
        try:
            await pool.call_all("/warm", {})  # connections made, the admin's thread started
            cpu0 = pool.admin_calls.cpu_s()
            call = asyncio.ensure_future(pool.call_all("/pause_generation", {"mode": "in_place"}))
            await asyncio.sleep(0)  # the call hands its fan-out to the admin's thread
            blocked_at = time.time()
            burn(0.6)  # the rollout loop runs one long callback
            unblocked_at = time.time()
            out = await call
            cpu = pool.admin_calls.cpu_s() - cpu0
            thread = pool.admin_calls.control.thread_id
            rollout_conns = [s.conns.stats()["live"] for s in pool.states]
        finally:
            await pool.aclose()
        return out, cpu, blocked_at, unblocked_at, thread, pool.admin_calls.control.thread_id, rollout_conns

    out, cpu, blocked_at, unblocked_at, thread, after_close, rollout_conns = rollout.run(scenario(), 30)
    assert out == {a: {"success": True} for a in servers}
    # Every server answered while the rollout loop was still blocked ...
    for a in servers:
        (t,) = answered_at(a, "/pause_generation")
        assert blocked_at <= t < unblocked_at, (a, t - blocked_at, unblocked_at - blocked_at)
    # ... and the admin's CPU clock does not hold the 0.6 s the rollout loop burnt meanwhile.
    assert 0 < cpu < 0.2, cpu
    assert thread is not None and after_close is None  # aclose() ends the admin's thread
    assert rollout_conns == [0] * len(servers)  # none of the generation path's connections used


def test_admin_failures_are_judged_on_the_admin_thread_and_name_each_server(servers, rollout):
    async def scenario():
        pool = ServerPool(servers[:2] + ["127.0.0.1:9"], wire=SGLangWire(), max_inflight=4,
                          request_timeout_s=5, unhealthy_after=1)
        try:
            with pytest.raises(ServerAdminError) as refused:
                await pool.call_all("/refuse", {}, servers=pool.states[:2])
            with pytest.raises(ServerAdminError) as dead:
                await pool.call_all("/pause_generation", {"mode": "retract"})
            per_server = await pool.call_all("/per", per_server=lambda i, s: {"rank_offset": i},
                                             servers=pool.states[:2])
            return refused.value, dead.value, pool.healthy, per_server
        finally:
            await pool.aclose()

    refused, dead, healthy, per_server = rollout.run(scenario(), 30)
    assert set(refused.failures) == set(servers[:2])
    assert all("HTTP 400: not while paused" in why for why in refused.failures.values())
    assert list(dead.failures) == ["127.0.0.1:9"] and "cannot connect" in dead.failures["127.0.0.1:9"]
    assert set(dead.results) == set(servers[:2])
    assert healthy == servers[:2]  # the fault was applied on the rollout loop: out of rotation
    assert per_server == {a: {"success": True} for a in servers[:2]}


def test_warmed_connections_carry_the_next_fan_out(servers, rollout):
    # A weight publisher opens the admin's connections (from its own thread) while the weights
    # are staged; the pause that follows goes over them and opens none of its own.
    pool = ServerPool(servers, wire=SGLangWire(), max_inflight=4, request_timeout_s=10)
    rollout.run(asyncio.sleep(0))
    SGLangAdmin(pool).warm_connections()  # this thread, not the rollout loop: returns at once
    deadline = time.monotonic() + 10
    while pool.admin_calls.control.connection_stats() != {a: {"idle": 1, "live": 1} for a in servers}:
        assert time.monotonic() < deadline, pool.admin_calls.control.connection_stats()
        time.sleep(0.01)
    out = rollout.run(pool.call_all("/continue_generation", {}), 30)
    assert out == {a: {"success": True} for a in servers}
    assert pool.admin_calls.control.connection_stats() == {a: {"idle": 1, "live": 1} for a in servers}
    rollout.run(pool.aclose(), 30)
