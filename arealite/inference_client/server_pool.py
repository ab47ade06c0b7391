"""The inference servers as the client sees them: rotation, health, routing, HTTP.

`ServerPool` holds one `ServerState` per server and everything shared by the
generation path (`remote_client.py`) and the administration (`sglang_admin.py`):

- **Rotation**: a server that fails several times in a row leaves the rotation
  (`take_out`: its queued and in-flight attempts are cancelled so that they move)
  until a health probe brings it back; one that missed a weight update while out is
  ``excluded`` and never comes back (it would serve an old policy).
- **The servers' pause**: while an admin ``pause_generation`` lasts (`hold`), requests
  wait in the client rather than on the paused servers (`running`).
- **HTTP**: one aiohttp session (probes, https) and, per plain-http server, an
  `Http1Pool` for the generation hot path; `call_all` sends one admin call to many
  servers at once and raises one `ServerAdminError` naming every failure. Its POSTs to
  plain-http servers go out on the admin's own thread (`control_plane.ControlPlane`,
  its own loop and connections), so that a weight update's fan-out waits behind none of
  the rollout's callbacks; the answers are applied back here, on the rollout loop, which
  alone owns the pool's state.

`ServerPoolView` is what the client and the admin both show of their one pool (the
servers, which are in rotation, what each said about itself, dropping the unreachable):
written once, so that both see the same rotation.

`Router` picks the server of a request: affinity first, else round-robin.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TypeVar
import aiohttp

from arealite.inference_client.control_plane import AdminCalls, judge_answer, results_of
from arealite.inference_client.errors import NoHealthyServerError, ServerStartupError
from arealite.inference_client.http1 import Http1Pool, HttpResponseTooLarge
from arealite.inference_client.wire import JSON_HEADERS, WireFormat, describe, dumps, loads, snippet
from arealite.utils.json_types import JsonObject, JsonValue

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["Attempt", "Router", "ServerPool", "ServerPoolView", "ServerState", "normalize_addr"]

_AFFINITY_CACHE = 100_000  # affinity keys remembered (LRU); old groups are done anyway


def normalize_addr(addr: str) -> tuple[str, str]:
    """ "host:port" or "http(s)://host:port[/]" -> (host:port, base url)."""
    if not isinstance(addr, str) or not addr.strip():
        raise ValueError(f"server address {addr!r} is not a 'host:port' string")
    text = addr.strip().rstrip("/")
    scheme = "http"
    if "://" in text:
        scheme, _, text = text.partition("://")
        if scheme not in ("http", "https"):
            raise ValueError(f"server address {addr!r}: scheme must be http or https, got {scheme!r}")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in text:
        raise ValueError(
            f"server address {addr!r} is not of the form 'host:port' (e.g. '127.0.0.1:30000')"
        )
    return text, f"{scheme}://{text}"


class Attempt:
    """An HTTP attempt, queued for a slot or in flight; eviction cancels its task so it
    can move elsewhere."""

    __slots__ = ("task", "evicted")

    def __init__(self, task: asyncio.Task | None):
        self.task = task
        self.evicted: str | None = None


class ServerState:
    """One server: its slot semaphore, health, what it said about itself, its connections."""

    __slots__ = (
        "addr", "base_url", "sem", "healthy", "reason", "consecutive_failures", "inflight",
        "attempts", "info", "version_text", "version", "tp_size", "last_probe", "probing",
        "excluded", "n_ok", "n_failed", "conns", "routes", "liveness", "warm",
    )

    def __init__(self, addr: str, base_url: str, max_inflight: int):
        self.addr = addr
        self.base_url = base_url
        self.sem = asyncio.Semaphore(max_inflight)
        self.healthy = True
        self.reason = ""  # why it left the rotation
        self.consecutive_failures = 0
        self.inflight = 0
        self.attempts: set[Attempt] = set()
        self.info: JsonObject = {}
        self.version_text: str | None = None
        self.version: tuple[int, int, int, int] | None = None
        self.tp_size = 1  # ranks this server contributes to a weight-update group
        self.last_probe = 0.0
        self.probing = False
        # Set when the server missed a weight update while out of rotation: a health
        # probe must not bring it back, or it would serve an old policy.
        self.excluded: str | None = None
        self.n_ok = 0
        self.n_failed = 0
        # Keep-alive connections for generation (plain http only; https goes through aiohttp).
        self.conns: Http1Pool | None = None
        # The routes it serves (its OpenAPI document), None when it does not say.
        self.routes: frozenset[str] | None = None
        self.liveness = ""  # the route that tells it is alive without generating
        # Its start-up warm-up is over (`arealite.inference_client.server_ready`): only then may it
        # be paused, or SGLang's own warm-up request may time out waiting and kill it.
        self.warm = False

    def serves(self, route: str) -> bool | None:
        """Whether the server has ``route`` (None: it did not list its routes)."""
        return None if self.routes is None else route in self.routes


class ServerPool:
    """The servers of one client: rotation, health probes, the servers' pause, HTTP.

    ``owner`` names the client in error messages. A server leaves the rotation after
    ``unhealthy_after`` consecutive failures and is probed every ``probe_interval_s``
    seconds to come back.
    """

    def __init__(self, addrs: Sequence[str] | str, *, wire: WireFormat, max_inflight: int,
                 request_timeout_s: float, api_key: str | None = None, unhealthy_after: int = 3,
                 probe_interval_s: float = 5.0, owner: str = "SGLangClient",
                 max_response_bytes: int = 64 << 20):
        if isinstance(addrs, str):
            addrs = [a for a in addrs.split(",") if a.strip()]
        if not addrs:
            raise ValueError(f"{owner} needs at least one server address 'host:port'")
        if unhealthy_after < 1:
            raise ValueError(f"unhealthy_after={unhealthy_after} must be >= 1")
        self.wire, self.owner = wire, owner
        self.states: list[ServerState] = []
        self.by_addr: dict[str, ServerState] = {}
        for a in addrs:
            addr, base = normalize_addr(a)
            if addr in self.by_addr:
                raise ValueError(f"server address {a!r} is listed twice")
            s = ServerState(addr, base, max_inflight)
            self.states.append(s)
            self.by_addr[addr] = s
        self.max_inflight = max_inflight
        self.max_response_bytes = int(max_response_bytes)  # no answer read is larger
        self.request_timeout_s = request_timeout_s
        self.unhealthy_after = int(unhealthy_after)
        self.probe_interval = float(probe_interval_s)
        self.probe_timeout = aiohttp.ClientTimeout(total=min(5.0, request_timeout_s))
        self.n_unhealthy = 0
        self.counts = {"marked_unhealthy": 0, "recovered": 0}
        # Cleared by the admin's pause_generation, set by continue_generation: while clear,
        # requests wait in the client, so that the time a weight update takes is no
        # request's timeout.
        self.running = asyncio.Event()
        self.running.set()
        self.paused_at = 0.0
        # Clear while the pause is being fanned out (`pausing`): the answers it aborts wait for
        # it before they are parsed, so that the fan-out is not queued behind hundreds of them.
        self.pause_sent = asyncio.Event()
        self.pause_sent.set()
        # How long the servers may take to start (`initialize`'s timeout); also bounds the wait
        # for their start-up warm-up before the first pause.
        self.startup_timeout_s = 300.0
        self.session: aiohttp.ClientSession | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closed = False
        self._bg_tasks: set[asyncio.Task] = set()
        self._headers: dict[str, str] | None = {"Authorization": f"Bearer {api_key}"} if api_key else None
        # The admin's own thread (made on the first admin call) and the CPU admin calls cost.
        self.admin_calls = AdminCalls(owner, self._headers, self.max_response_bytes)

    # ------------------------------------------------------------------ state

    @property
    def addrs(self) -> list[str]:
        return [s.addr for s in self.states]

    @property
    def healthy(self) -> list[str]:
        return [s.addr for s in self.states if s.healthy]

    def get(self, addr: str) -> ServerState:
        key, _ = normalize_addr(addr)
        if key not in self.by_addr:
            raise ValueError(f"unknown server {addr!r}; known servers: {self.addrs}")
        return self.by_addr[key]

    def out_of_rotation(self) -> dict[str, str]:
        """Every server out of rotation and why."""
        return {s.addr: s.excluded or s.reason or "out of rotation" for s in self.states if not s.healthy}

    def hold(self) -> None:
        """The servers are being paused: hold (re)submissions in the client."""
        if self.running.is_set():
            self.paused_at = time.monotonic()
            self.running.clear()

    def release(self) -> None:
        """The servers continue: release what `hold` kept."""
        self.running.set()

    async def pausing(self, fan_out: Awaitable[T]) -> T:
        """Run the pause's ``fan_out`` (after `hold`) with ``pause_sent`` clear: the answers it
        aborts are parsed once every server answered it (their resubmissions wait for the
        continue anyway), in the transfer's time rather than on the pause's path."""
        self.pause_sent.clear()
        try:
            return await fan_out
        finally:
            self.pause_sent.set()

    # --------------------------------------------------------------- rotation

    def take_out(self, s: ServerState, reason: str) -> None:
        """Take `s` out of rotation; its queued and in-flight attempts are cancelled (they move)."""
        if s.healthy:
            s.healthy = False
            self.n_unhealthy += 1
            self.counts["marked_unhealthy"] += 1
            s.last_probe = time.monotonic()
            logger.warning("inference server %s leaves the rotation: %s", s.addr, reason)
        s.reason = reason
        for att in list(s.attempts):
            if att.evicted is None and att.task is not None and not att.task.done():
                att.evicted = reason
                att.task.cancel()

    def bring_back(self, s: ServerState) -> None:
        if not s.healthy and s.excluded is None:
            s.healthy = True
            s.reason = ""
            s.consecutive_failures = 0
            self.n_unhealthy -= 1
            self.counts["recovered"] += 1
            logger.warning("inference server %s is back in rotation", s.addr)

    def record_admin_fault(self, s: ServerState) -> None:
        # A dead server should not fail every later admin call forever: count it.
        s.consecutive_failures += 1
        if s.healthy and s.consecutive_failures >= self.unhealthy_after:
            self.take_out(s, f"{s.consecutive_failures} consecutive failures (admin calls)")

    def exclude_unhealthy(self, why: str) -> None:
        """Servers out of rotation miss a weight update: keep them out for good."""
        for s in self.states:
            if not s.healthy and s.excluded is None:
                s.excluded = why
                logger.warning("%s missed %s; it stays out of rotation", s.addr, why)

    def schedule_probes(self) -> None:
        """Probe, in the background, the servers out of rotation whose probe is due."""
        now = time.monotonic()
        for s in self.states:
            if (not s.healthy and s.excluded is None and not s.probing
                    and now - s.last_probe >= self.probe_interval):
                t = asyncio.get_running_loop().create_task(self.probe(s))
                self._bg_tasks.add(t)
                t.add_done_callback(self._bg_tasks.discard)

    async def probe(self, s: ServerState) -> bool:
        """Check health once; a server that answers 200 comes back into rotation."""
        if s.probing:
            return False
        s.probing = True
        s.last_probe = time.monotonic()
        try:
            # Out of a pause, coming back needs a token generated; during one, an answer.
            ok = await self._alive(s, generating=self.running.is_set())
        finally:
            s.probing = False
        if ok:
            self.bring_back(s)
        return ok

    def liveness_route(self, s: ServerState) -> str:
        """The route that proves ``s`` alive without generating (SGLang's ``/health``
        generates, so while paused it waits and then fails)."""
        return s.liveness or self.wire.liveness_routes[-1]

    async def _alive(self, s: ServerState, generating: bool = False) -> bool:
        route = self.wire.health_route if generating else self.liveness_route(s)
        try:
            async with self.ensure_session().get(s.base_url + route, timeout=self.probe_timeout) as r:
                await r.read()
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def drop_unreachable(self, addrs: Iterable[str] | None = None, why: str = "") -> list[str]:
        """Probe the given servers in rotation (default: all); those that do not answer leave it
        for good and are returned."""
        targets = [self.get(a) for a in addrs] if addrs is not None else list(self.states)
        targets = [s for s in dict.fromkeys(targets) if s.healthy]
        oks = await asyncio.gather(*(self._alive(s) for s in targets))
        dropped = []
        for s, ok in zip(targets, oks):
            if ok:
                continue
            self.drop(s, f"no answer to {self.liveness_route(s)}{f' after {why}' if why else ''}")
            dropped.append(s.addr)
        return dropped

    def drop(self, s: ServerState, reason: str) -> None:
        """Take ``s`` out of rotation for good (it misses weight updates from now on)."""
        self.take_out(s, reason)
        s.excluded = s.excluded or reason

    # -------------------------------------------------------------- lifecycle

    def ensure_session(self) -> aiohttp.ClientSession:
        if self.closed:
            raise RuntimeError(f"{self.owner} is closed (aclose() was called)")
        if self.session is None:
            self.loop = asyncio.get_running_loop()
            per_host = self.max_inflight
            # Headroom above the in-flight bound, so that admin calls (pause_generation
            # during a weight update) never queue behind generation requests for a socket.
            connector = aiohttp.TCPConnector(limit=len(self.states) * (per_host + 16),
                                             limit_per_host=per_host + 16, keepalive_timeout=60)
            headers = self._headers
            self.session = aiohttp.ClientSession(connector=connector, headers=headers,
                                                 timeout=aiohttp.ClientTimeout(total=None), trust_env=False)
            for s in self.states:
                if s.base_url.startswith("http://"):
                    host, _, port = s.addr.rpartition(":")
                    s.conns = Http1Pool(host.strip("[]"), int(port), headers,
                                        max_body=self.max_response_bytes)
        return self.session

    async def initialize(self, timeout: float) -> None:
        """Wait until every server is healthy (at most ``timeout`` s), then read what each
        says about itself. Raises `ServerStartupError` naming the servers that never answered."""
        self.ensure_session()
        self.startup_timeout_s = float(timeout)
        deadline = time.monotonic() + timeout
        causes = await asyncio.gather(*(self._wait_healthy(s, deadline) for s in self.states))
        failed = {s.addr: c for s, c in zip(self.states, causes) if c is not None}
        if failed:
            detail = "; ".join(f"{a} ({c})" for a, c in failed.items())
            raise ServerStartupError(
                f"{len(failed)} of {len(self.states)} server(s) never answered "
                f"{' or '.join([*self.wire.liveness_routes, self.wire.health_route])} within {timeout:g}s: "
                f"{detail}")
        await asyncio.gather(*(self._read_info(s) for s in self.states))

    async def _wait_healthy(self, s: ServerState, deadline: float) -> str | None:
        """Wait until `s` answers a liveness route (not SGLang's generating /health: a server
        left paused by a trainer that died mid-push would never pass it; the run's first
        weight push continues it)."""
        session = self.ensure_session()
        cause, pause_s = "no answer", 0.05
        # The oldest name first (every release has it), the generating health route last.
        routes = [*reversed(self.wire.liveness_routes), self.wire.health_route]
        while True:
            left = deadline - time.monotonic()
            try:
                async with session.get(s.base_url + routes[0],
                                       timeout=aiohttp.ClientTimeout(total=max(0.1, min(5.0, left)))) as resp:
                    await read_body(resp, self.max_response_bytes)
                    if resp.status == 200:
                        return None
                    cause = f"HTTP {resp.status}"
                    if resp.status == 404 and len(routes) > 1:
                        routes.pop(0)  # a release without this name: try the next one at once
                        continue
                    if resp.status in (401, 403):
                        return f"HTTP {resp.status}: the server rejected the api key"
            except (aiohttp.ClientError, TimeoutError, HttpResponseTooLarge) as e:
                cause = describe(e)
            left = deadline - time.monotonic()
            if left <= 0:
                return cause
            await asyncio.sleep(min(pause_s, left))
            pause_s = min(pause_s * 2, 1.0)

    async def _get(self, s: ServerState, route: str) -> tuple[int, bytes]:
        try:
            async with self.ensure_session().get(s.base_url + route, timeout=self.probe_timeout) as resp:
                return resp.status, await read_body(resp, self.max_response_bytes)
        except (aiohttp.ClientError, TimeoutError, HttpResponseTooLarge) as e:
            raise ServerStartupError(f"{s.addr}{route} failed: {describe(e)}") from None

    async def _read_info(self, s: ServerState) -> None:
        """What the server says about itself (the first info route it serves) and its routes."""
        for route in self.wire.info_routes:
            status, raw = await self._get(s, route)
            if status != 404:
                break
        if status != 200:
            raise ServerStartupError(f"{s.addr}{route} answered HTTP {status}: {snippet(raw)}")
        try:
            info = loads(raw)
        except ValueError:
            raise ServerStartupError(f"{s.addr}{route} did not return JSON: {snippet(raw)}") from None
        if not isinstance(info, dict):
            raise ServerStartupError(f"{s.addr}{route} returned {type(info).__name__}, not an object")
        s.info = info
        self._fit_inflight(s, info.get("max_running_requests"))
        s.version_text, s.version, s.tp_size = self.wire.server_facts(s.addr, info)
        s.routes = await self._read_routes(s)
        live = [r for r in self.wire.liveness_routes if s.serves(r)]
        s.liveness = live[0] if live else self.wire.liveness_routes[-1]

    def _fit_inflight(self, s: ServerState, running: JsonValue) -> None:
        """Send a server at most twice the requests it says it runs at once
        (``max_running_requests``, when it reports a number): one batch running and one
        waiting to step in. Beyond that, requests only wait in its queue, and a weight
        update's pause aborts the whole queue (SGLang's abort mode), so each of them would
        cost an abort and a resubmission per update; the rest wait in the client instead."""
        if isinstance(running, int) and not isinstance(running, bool) and 0 < 2 * running < self.max_inflight:
            s.sem = asyncio.Semaphore(2 * running)
            logger.info("%s runs at most %d requests at once: at most %d in flight there", s.addr, running,
                        2 * running)

    async def _read_routes(self, s: ServerState) -> frozenset[str] | None:
        """The paths of the server's OpenAPI document; None (logged) when it has none."""
        route = self.wire.routes_route
        if route is None:
            return None
        status, raw = await self._get(s, route)
        try:
            paths = loads(raw).get("paths") if status == 200 else None
        except (ValueError, AttributeError):
            paths = None
        if not isinstance(paths, dict):
            logger.warning("%s: no route list at %s (HTTP %d); optional routes are chosen by the "
                           "release it reports (%s)", s.addr, route, status, s.version_text)
            return None
        return frozenset(p for p in paths if isinstance(p, str))

    async def aclose(self) -> None:
        """Stop background probes, close every connection."""
        self.closed = True
        for t in list(self._bg_tasks):
            t.cancel()
        if self._bg_tasks:
            await asyncio.gather(*self._bg_tasks, return_exceptions=True)
        for s in self.states:
            if s.conns is not None:
                await s.conns.aclose()
        self.admin_calls.close()
        if self.session is not None:
            session, self.session = self.session, None
            await session.close()

    # ----------------------------------------------------------- admin calls

    async def call_all(
        self, route: str, payload: JsonObject | None = None, *,
        servers: list[ServerState] | None = None,
        per_server: Callable[[int, ServerState], JsonObject] | None = None,
        timeout: float | None = None, method: str = "POST",
    ) -> dict[str, JsonValue]:
        """Send one call to every target (default: the servers in rotation) concurrently.

        Returns ``{addr: answer}``; raises `ServerAdminError` naming every server that failed
        (no answer, HTTP error, or ``success: false``). POSTs to plain-http servers go out
        on the admin's own thread (`ControlPlane`), the same encoded body to every server
        unless ``per_server`` gives each its own.
        """
        cpu0 = time.thread_time()
        self.ensure_session()
        targets = servers if servers is not None else [s for s in self.states if s.healthy]
        if not targets:
            detail = "; ".join(f"{x.addr}: {x.excluded or x.reason}" for x in self.states)
            raise NoHealthyServerError(f"{route}: no healthy inference server ({detail})")
        total = timeout if timeout is not None else self.request_timeout_s
        if method == "POST" and (payload is not None or per_server is not None) and all(
                s.conns is not None for s in targets):
            if per_server is None:
                bodies = [dumps(payload)] * len(targets)  # encoded once, the same bytes to every server
            else:
                bodies = [dumps(per_server(i, s)) for i, s in enumerate(targets)]
            return await self.admin_calls.call(targets, route, bodies, total, self.record_admin_fault, cpu0)
        self.admin_calls.count_since(cpu0)
        t = aiohttp.ClientTimeout(total=total)
        answers = await asyncio.gather(*(
            self._call_one(s, route, per_server(i, s) if per_server is not None else payload, t, method)
            for i, s in enumerate(targets)))
        return results_of(route, [s.addr for s in targets], answers)

    async def _call_one(self, s: ServerState, route: str, body: JsonObject | None,
                        t: aiohttp.ClientTimeout, method: str) -> tuple[JsonValue, str | None]:
        """(answer, None) or (answer or None, why it failed)."""
        try:
            status, raw = await self._exchange(s, route, body, t, method)
        except TimeoutError:
            self.record_admin_fault(s)
            return None, f"no answer within {t.total:g}s"
        except (aiohttp.ClientError, ConnectionError) as e:  # Http1Pool's errors are ConnectionErrors
            self.record_admin_fault(s)
            return None, describe(e)
        return judge_answer(status, raw)

    async def _exchange(self, s: ServerState, route: str, body: JsonObject | None,
                        t: aiohttp.ClientTimeout, method: str) -> tuple[int, bytes]:
        """One admin exchange: a POST with a body over the server's own HTTP/1.1 pool when it
        has one (a fan-out to hundreds of servers costs a fraction of aiohttp's CPU per call),
        anything else over the aiohttp session."""
        if s.conns is not None and method == "POST" and body is not None:
            return await s.conns.post(route, dumps(body), t.total, max_body=self.max_response_bytes)
        async with self.ensure_session().request(
            method, s.base_url + route, data=dumps(body) if body is not None else None,
            headers=JSON_HEADERS if body is not None else None, timeout=t,
        ) as resp:
            return resp.status, await read_body(resp, self.max_response_bytes)


class ServerPoolView:
    """The servers of one `ServerPool` as its users see them.

    The inference client and the admin over the same pool are both one, so a server that
    leaves the rotation for one has left it for the other. The admin's part of
    ``WeightUpdateAdmin`` (`arealite.api.contracts`).
    """

    pool: ServerPool

    def __repr__(self) -> str:  # never shows the api key
        return f"{type(self).__name__}(servers={self.servers}, healthy={self.healthy_servers})"

    @property
    def servers(self) -> list[str]:
        """All server addresses ("host:port"), in the order given."""
        return self.pool.addrs

    @property
    def healthy_servers(self) -> list[str]:
        """Addresses of the servers currently in rotation."""
        return self.pool.healthy

    def server_info(self, addr: str) -> JsonObject:
        """What a server reported about itself at start-up (``/server_info``; empty if unknown)."""
        return dict(self.pool.get(addr).info)

    def out_of_rotation(self) -> dict[str, str]:
        """Every server out of rotation and why."""
        return self.pool.out_of_rotation()

    def admin_cpu_s(self) -> float:
        """CPU seconds the admin calls have cost the client so far (`AdminCalls.cpu_s`; any
        thread may read it: a weight update's clock is the difference of two readings)."""
        return self.pool.admin_calls.cpu_s()

    def warm_connections(self) -> None:
        """Open the admin's connections to every server now, without waiting (any thread): the
        weight publisher calls it before it stages the weights, so that the pause that follows
        does not connect on the update's critical path."""
        pool = self.pool
        addrs = [s.addr for s in list(pool.states) if s.healthy and s.base_url.startswith("http://")]
        if addrs and not pool.closed:
            pool.admin_calls.warm(addrs, min(5.0, pool.request_timeout_s))

    async def drop_unreachable(self, addrs: Iterable[str] | None = None, why: str = "") -> list[str]:
        """Probe the given servers in rotation (default: all of them).

        Those that do not answer within the probe timeout leave the rotation for good
        (they miss weight updates, so a later probe must not bring them back with old
        weights) and are returned. Used after a failed admin call, to tell a dead server
        from a refused request.
        """
        return await self.pool.drop_unreachable(addrs, why)


class Router:
    """Chooses the server of each request: affinity first, else round-robin over the
    servers in rotation, preferring one with a free slot."""

    def __init__(self, pool: ServerPool):
        self.pool = pool
        self._affinity: OrderedDict[str, str] = OrderedDict()
        self._rr = 0

    async def pick(self, key: str | None, exclude: set[str]) -> ServerState:
        """`choose`, probing the servers out of rotation when it finds nobody."""
        pool = self.pool
        if pool.n_unhealthy:
            pool.schedule_probes()
        s = self.choose(key, exclude)
        if s is None:
            # Nobody is in rotation: probe everyone now rather than fail on stale news.
            await asyncio.gather(*(pool.probe(x) for x in pool.states if not x.healthy and x.excluded is None))
            s = self.choose(key, exclude)
            if s is None:
                detail = "; ".join(f"{x.addr}: {x.excluded or x.reason}" for x in pool.states)
                raise NoHealthyServerError(f"no healthy inference server ({detail})")
        return s

    def choose(self, key: str | None, exclude: set[str]) -> ServerState | None:
        """Affinity first; else round-robin, preferring a server with a free slot."""
        owner = None
        if key is not None:
            addr = self._affinity.get(key)
            if addr is not None:
                owner = self.pool.by_addr[addr]
                if owner.healthy and addr not in exclude:
                    self._affinity.move_to_end(key)
                    return owner
        servers = self.pool.states
        n = len(servers)
        best = None
        for _ in range(n):
            s = servers[self._rr % n]
            self._rr += 1
            if not s.healthy or s.addr in exclude:
                continue
            if not s.sem.locked():
                best = s
                break
            if best is None:
                best = s
        if best is None:
            if exclude:  # every healthy server was tried already: try them again
                return self.choose(key, set())
            return None
        # A retry after a one-off failure moves only this attempt; a key whose server
        # left the rotation moves for good.
        if key is not None and (owner is None or not owner.healthy):
            self._affinity[key] = best.addr
            self._affinity.move_to_end(key)
            if len(self._affinity) > _AFFINITY_CACHE:
                self._affinity.popitem(last=False)
        return best


async def read_body(resp: aiohttp.ClientResponse, cap: int) -> bytes:
    """The body of ``resp``, refused (`HttpResponseTooLarge`) past ``cap`` bytes: from its
    ``Content-Length`` before reading, else as it arrives (after decompression, if any)."""
    if resp.content_length is not None and resp.content_length > cap:
        raise HttpResponseTooLarge(f"Content-Length {resp.content_length} exceeds max_response_bytes={cap}")
    parts, n = [], 0
    while True:
        part = await resp.content.read(1 << 16)
        if not part:
            return b"".join(parts)
        n += len(part)
        if n > cap:
            raise HttpResponseTooLarge(f"response body exceeds max_response_bytes={cap}")
        parts.append(part)
