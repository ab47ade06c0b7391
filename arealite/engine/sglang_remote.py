"""Inference client: ``RemoteSGLangEngine`` speaks SGLang's HTTP protocol.

It turns a ``GenerationRequest`` into a ``Completion`` on one of several
inference servers (SGLang or arealite's embedded server; it cannot tell them
apart) and hides what goes wrong on the way:

- **Routing**: round-robin over healthy servers, with affinity: requests that
  share ``affinity_key`` (the samples of a group, the turns of a conversation)
  go to the same server, so its prefix cache is reused. If that server leaves
  the rotation, the key moves to another one.
- **Back-pressure**: at most ``max_inflight_per_server`` requests per server;
  the others queue for a slot (and move at once if the server leaves the rotation).
- **Interruptible generation**: a weight update pauses the servers, which
  return in-flight requests with finish reason ``abort`` and their partial
  output. The client resubmits prompt + partial output with a lower
  ``max_new_tokens``; every token keeps the ``weight_version`` of the response
  segment that produced it, so the completion is seamless. While a pause issued
  through this client lasts, the client itself holds resubmissions and new
  submissions (rather than the paused server, against their request timeout).
- **Faults**: timeouts, connection errors, HTTP 5xx and malformed responses are
  retried with exponential backoff on another healthy server; a server that
  fails several times in a row leaves the rotation until a ``/health`` probe
  brings it back. A 4xx is the caller's fault and is raised at once.
- **Admin calls** used by weight synchronisation go to every healthy server
  concurrently and raise one error naming every server that failed.

All coroutines run on one event loop (the rollout controller's, uvloop).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import OrderedDict
from typing import Any, Callable, Iterable, Sequence

import aiohttp

from arealite.api.types import Completion, GenerationRequest
from arealite.config.schema import RolloutConfig
from arealite.engine.http1 import Http1Pool, HttpConnectionError, HttpProtocolError

try:  # orjson is several times faster on token-id lists; plain json is the fallback.
    import orjson

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

    _loads = orjson.loads
except ImportError:  # pragma: no cover - exercised only without orjson
    import json

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    _loads = json.loads

logger = logging.getLogger(__name__)

__all__ = [
    "RemoteSGLangEngine",
    "GenerationError",
    "BadRequestError",
    "NoHealthyServerError",
    "ServerAdminError",
    "ServerStartupError",
    "parse_sglang_version",
    "WEIGHT_UPDATE_BRACKETS_SINCE",
]

#: First SGLang release with ``/begin_weight_update`` and ``/end_weight_update``.
WEIGHT_UPDATE_BRACKETS_SINCE = (0, 5, 21)

_JSON_HEADERS = {"Content-Type": "application/json"}
_FINISH_REASONS = ("stop", "length", "abort")
# A server that keeps aborting a request before it produced a single token is
# broken, not paused (a paused server holds new requests): give up after this many.
_MAX_EMPTY_ABORTS = 100
_AFFINITY_CACHE = 100_000  # affinity keys remembered (LRU); old groups are done anyway
_RETRYABLE_4XX = (408, 429)  # request timeout / too many requests: the server's state, not ours


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


class GenerationError(RuntimeError):
    """A generation request failed for good: its retry budget is spent.

    The message names every server tried, the route and the cause of each failure.
    """


class BadRequestError(GenerationError):
    """The server rejected the request (HTTP 4xx); retrying would not help."""

    def __init__(self, server: str, route: str, status: int, message: str):
        self.server, self.route, self.status, self.server_message = server, route, status, message
        super().__init__(f"{server}{route} rejected the request with HTTP {status}: {message}")


class NoHealthyServerError(GenerationError):
    """Every server is out of rotation (failed repeatedly and failed its health probe)."""


class ServerAdminError(RuntimeError):
    """An admin call (pause, weight update, ...) failed on one or more servers.

    ``failures`` maps each failing server to its cause; ``results`` holds the
    answers of the servers that succeeded.
    """

    def __init__(self, route: str, failures: dict[str, str], results: dict[str, Any]):
        self.route, self.failures, self.results = route, failures, results
        detail = "; ".join(f"{addr}: {cause}" for addr, cause in failures.items())
        super().__init__(f"{route} failed on {len(failures)} server(s): {detail}")


class ServerStartupError(RuntimeError):
    """Servers did not become healthy within the start-up timeout."""


class _AttemptFailure(Exception):
    """One HTTP attempt failed in a way another server may not (retryable)."""

    def __init__(self, kind: str, cause: str):
        self.kind = kind  # timeout | connection | http_5xx | malformed | evicted
        super().__init__(cause)


# ---------------------------------------------------------------------------
# Versions
# ---------------------------------------------------------------------------

_VERSION_RE = re.compile(
    r"^\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?"
    r"(?:[.\-_]?(?P<tag>a|alpha|b|beta|c|rc|pre|preview|dev|post)\.?\d*)?",
    re.IGNORECASE,
)


def parse_sglang_version(text: Any) -> tuple[int, int, int, int] | None:
    """Parse a release string such as "0.5.23", "0.5.21rc1", "0.5.3.post1".

    Returns ``(major, minor, patch, stage)`` where ``stage`` is -1 for a
    pre-release (a/b/rc/dev), 0 for a release and 1 for a post-release, so that
    tuples order as PEP 440 does ("0.5.21rc1" < "0.5.21" < "0.5.21.post1").
    Returns None when the text holds no version.
    """
    if not isinstance(text, str):
        return None
    m = _VERSION_RE.match(text)
    if m is None:
        return None
    tag = (m.group("tag") or "").lower()
    stage = 1 if tag == "post" else (-1 if tag else 0)
    return (int(m.group(1)), int(m.group(2) or 0), int(m.group(3) or 0), stage)


def _normalize_addr(addr: Any) -> tuple[str, str]:
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


# ---------------------------------------------------------------------------
# Per-server state
# ---------------------------------------------------------------------------


class _Attempt:
    """An HTTP attempt, queued for a slot or in flight; eviction cancels its task so it
    can move elsewhere."""

    __slots__ = ("task", "evicted")

    def __init__(self, task: asyncio.Task | None):
        self.task = task
        self.evicted: str | None = None


class _Server:
    __slots__ = (
        "addr", "base_url", "sem", "healthy", "reason", "consecutive_failures", "inflight",
        "attempts", "info", "version_text", "version", "tp_size", "last_probe", "probing",
        "excluded", "n_ok", "n_failed", "pool",
    )

    def __init__(self, addr: str, base_url: str, max_inflight: int):
        self.addr = addr
        self.base_url = base_url
        self.sem = asyncio.Semaphore(max_inflight)
        self.healthy = True
        self.reason = ""  # why it left the rotation
        self.consecutive_failures = 0
        self.inflight = 0
        self.attempts: set[_Attempt] = set()
        self.info: dict[str, Any] = {}
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
        # Keep-alive connections for /generate (plain http only; https goes through aiohttp).
        self.pool: Http1Pool | None = None


# ---------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------


class RemoteSGLangEngine:
    """Inference engine over HTTP: generation and admin calls to SGLang-compatible servers.

    ``addrs`` are "host:port" (or "http://host:port"). ``api_key`` is sent as
    ``Authorization: Bearer <key>`` on every request and never logged.
    ``eos_token_ids`` (optional) are treated as stop tokens when an aborted
    segment ends on one. A server leaves the rotation after
    ``unhealthy_after`` consecutive failures and is probed every
    ``health_probe_interval_s`` seconds to come back. Requests held by
    ``pause_generation`` fail once the pause has lasted ``max_pause_s`` seconds
    without ``continue_generation`` (a weight update that died half-way).
    """

    def __init__(
        self,
        addrs: Sequence[str],
        config: RolloutConfig | None = None,
        api_key: str | None = None,
        *,
        eos_token_ids: Iterable[int] = (),
        unhealthy_after: int = 3,
        health_probe_interval_s: float = 5.0,
        max_pause_s: float = 3600.0,
    ):
        if isinstance(addrs, str):
            addrs = [a for a in addrs.split(",") if a.strip()]
        if not addrs:
            raise ValueError("RemoteSGLangEngine needs at least one server address 'host:port'")
        if unhealthy_after < 1:
            raise ValueError(f"unhealthy_after={unhealthy_after} must be >= 1")
        if not max_pause_s > 0:
            raise ValueError(f"max_pause_s={max_pause_s} must be > 0 (seconds)")
        self.config = config if config is not None else RolloutConfig()
        self._api_key = api_key
        self._servers: list[_Server] = []
        self._by_addr: dict[str, _Server] = {}
        for a in addrs:
            addr, base = _normalize_addr(a)
            if addr in self._by_addr:
                raise ValueError(f"server address {a!r} is listed twice")
            s = _Server(addr, base, self.config.max_inflight_per_server)
            self._servers.append(s)
            self._by_addr[addr] = s
        self._eos_ids = frozenset(int(t) for t in eos_token_ids)
        self._unhealthy_after = int(unhealthy_after)
        self._probe_interval = float(health_probe_interval_s)
        self._req_timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
        self._probe_timeout = aiohttp.ClientTimeout(total=min(5.0, self.config.request_timeout_s))
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._gate = asyncio.Event()  # the client's own pause gate (set = running)
        self._gate.set()
        # Cleared by pause_generation, set by continue_generation: while clear, requests
        # wait here, so that the time a weight update takes is no request's timeout.
        self._servers_running = asyncio.Event()
        self._servers_running.set()
        self._paused_at = 0.0
        self._max_pause_s = float(max_pause_s)
        self._affinity: OrderedDict[Any, str] = OrderedDict()
        self._rr = 0
        self._n_unhealthy = 0
        self._version = 0
        self._groups: dict[str, list[str]] = {}  # weight-update group -> member servers
        self._bg_tasks: set[asyncio.Task] = set()
        self._closed = False
        self._counters = dict.fromkeys(
            (
                "requests", "completed", "failed", "bad_requests", "retries", "timeouts",
                "connection_errors", "http_5xx", "malformed", "evicted", "aborts",
                "empty_aborts", "interrupted_requests", "output_tokens", "marked_unhealthy",
                "recovered", "version_fallbacks",
            ),
            0,
        )

    def __repr__(self) -> str:  # never shows the api key
        return f"RemoteSGLangEngine(servers={self.servers}, healthy={self.healthy_servers})"

    # ------------------------------------------------------------------ state

    @property
    def servers(self) -> list[str]:
        """All server addresses ("host:port"), in the order given."""
        return [s.addr for s in self._servers]

    @property
    def healthy_servers(self) -> list[str]:
        """Addresses of the servers currently in rotation."""
        return [s.addr for s in self._servers if s.healthy]

    def get_version(self) -> int:
        """The client's view of the current policy version (for stats and fallbacks)."""
        return self._version

    def set_version(self, version: int) -> None:
        """Set the client's view of the current policy version."""
        self._version = int(version)

    def server_version(self, addr: str) -> str | None:
        """The release string a server reported in ``/get_server_info`` (None if unknown)."""
        return self._server(addr).version_text

    @property
    def paused(self) -> bool:
        """Whether the client's own gate holds new submissions."""
        return not self._gate.is_set()

    def pause(self) -> None:
        """Hold new submissions (and resubmissions after an abort) until ``resume()``."""
        self._on_loop(self._gate.clear)

    def resume(self) -> None:
        """Release submissions held by ``pause()``."""
        self._on_loop(self._gate.set)

    def stats(self) -> dict[str, Any]:
        """Counters (requests, retries, failures by cause, aborts ...) and per-server state."""
        out: dict[str, Any] = dict(self._counters)
        out["version"] = self._version
        out["n_healthy"] = len(self._servers) - self._n_unhealthy
        out["servers"] = {
            s.addr: {
                "healthy": s.healthy,
                "reason": s.reason,
                "excluded": s.excluded,
                "inflight": s.inflight,
                "completed": s.n_ok,
                "failed": s.n_failed,
                "release": s.version_text,
            }
            for s in self._servers
        }
        return out

    def mark_unhealthy(self, addr: str, reason: str) -> None:
        """Take a server out of rotation; its in-flight and queued requests move to other servers."""
        self._take_out(self._server(addr), reason)

    def server_info(self, addr: str) -> dict[str, Any]:
        """What a server reported in ``/get_server_info`` at ``initialize()`` (empty if unknown)."""
        return dict(self._server(addr).info)

    def group_members(self, group_name: str) -> list[str]:
        """The servers that joined weight-update group ``group_name`` (empty if unknown)."""
        return list(self._groups.get(group_name, ()))

    async def drop_unreachable(self, addrs: Iterable[str] | None = None, why: str = "") -> list[str]:
        """Probe ``/health`` of the given servers in rotation (default: all of them).

        Those that do not answer 200 within the probe timeout leave the rotation
        for good (they miss weight updates, so a later probe must not bring them
        back with old weights) and are returned. Used by weight sync after a
        failed admin call, to tell a dead server from a refused request.
        """
        session = self._ensure_session()
        targets = [self._server(a) for a in addrs] if addrs is not None else list(self._servers)
        targets = [s for s in dict.fromkeys(targets) if s.healthy]

        async def answers(s: _Server) -> bool:
            try:
                async with session.get(s.base_url + "/health", timeout=self._probe_timeout) as r:
                    await r.read()
                    return r.status == 200
            except (aiohttp.ClientError, TimeoutError):
                return False

        oks = await asyncio.gather(*(answers(s) for s in targets))
        dropped = []
        for s, ok in zip(targets, oks):
            if ok:
                continue
            reason = f"no answer to /health{f' after {why}' if why else ''}"
            self._take_out(s, reason)
            s.excluded = s.excluded or reason
            dropped.append(s.addr)
        return dropped

    # --------------------------------------------------------------- lifecycle

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError("RemoteSGLangEngine is closed (aclose() was called)")
        if self._session is None:
            self._loop = asyncio.get_running_loop()
            per_host = self.config.max_inflight_per_server
            # Headroom above the in-flight bound, so that admin calls (pause_generation
            # during a weight update) never queue behind generation requests for a socket.
            connector = aiohttp.TCPConnector(
                limit=len(self._servers) * (per_host + 16),
                limit_per_host=per_host + 16,
                keepalive_timeout=60,
            )
            headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else None
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=None),
                trust_env=False,
            )
            for s in self._servers:
                if s.base_url.startswith("http://"):
                    host, _, port = s.addr.rpartition(":")
                    s.pool = Http1Pool(host.strip("[]"), int(port), headers)
        return self._session

    async def initialize(self, timeout: float = 300.0) -> None:
        """Wait until every server answers ``/health`` (at most ``timeout`` s), then
        read ``/get_server_info`` (release, tp_size). Raises ``ServerStartupError``
        naming the servers that never answered and why."""
        session = self._ensure_session()
        deadline = time.monotonic() + timeout

        async def wait_healthy(s: _Server) -> str | None:
            cause, pause_s = "no answer", 0.05
            while True:
                left = deadline - time.monotonic()
                try:
                    async with session.get(
                        s.base_url + "/health",
                        timeout=aiohttp.ClientTimeout(total=max(0.1, min(5.0, left))),
                    ) as resp:
                        await resp.read()
                        if resp.status == 200:
                            return None
                        cause = f"HTTP {resp.status}"
                        if resp.status in (401, 403):
                            return f"HTTP {resp.status}: the server rejected the api key"
                except (aiohttp.ClientError, TimeoutError) as e:
                    cause = _describe(e)
                left = deadline - time.monotonic()
                if left <= 0:
                    return cause
                await asyncio.sleep(min(pause_s, left))
                pause_s = min(pause_s * 2, 1.0)

        causes = await asyncio.gather(*(wait_healthy(s) for s in self._servers))
        failed = {s.addr: c for s, c in zip(self._servers, causes) if c is not None}
        if failed:
            detail = "; ".join(f"{a} ({c})" for a, c in failed.items())
            raise ServerStartupError(
                f"{len(failed)} of {len(self._servers)} server(s) never answered /health "
                f"within {timeout:g}s: {detail}"
            )
        await asyncio.gather(*(self._read_server_info(s) for s in self._servers))

    async def _read_server_info(self, s: _Server) -> None:
        session = self._ensure_session()
        try:
            async with session.get(s.base_url + "/get_server_info", timeout=self._probe_timeout) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as e:
            raise ServerStartupError(f"{s.addr}/get_server_info failed: {_describe(e)}") from None
        if status != 200:
            raise ServerStartupError(
                f"{s.addr}/get_server_info answered HTTP {status}: {_snippet(raw)}"
            )
        try:
            info = _loads(raw)
        except ValueError:
            raise ServerStartupError(
                f"{s.addr}/get_server_info did not return JSON: {_snippet(raw)}"
            ) from None
        if not isinstance(info, dict):
            raise ServerStartupError(f"{s.addr}/get_server_info returned {type(info).__name__}, not an object")
        s.info = info
        s.version_text = info.get("version") if isinstance(info.get("version"), str) else None
        s.version = parse_sglang_version(s.version_text)
        if s.version is None:
            logger.warning(
                "%s: /get_server_info has no parsable 'version' (%r); assuming an SGLang "
                "release older than %s (begin/end_weight_update will be skipped)",
                s.addr, info.get("version"), ".".join(map(str, WEIGHT_UPDATE_BRACKETS_SINCE)),
            )
        tp = info.get("tp_size", 1)
        s.tp_size = tp if isinstance(tp, int) and tp >= 1 else 1

    async def aclose(self) -> None:
        """Close the HTTP session and stop background health probes."""
        self._closed = True
        for t in list(self._bg_tasks):
            t.cancel()
        if self._bg_tasks:
            await asyncio.gather(*self._bg_tasks, return_exceptions=True)
        for s in self._servers:
            if s.pool is not None:
                await s.pool.aclose()
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    async def __aenter__(self) -> "RemoteSGLangEngine":
        self._ensure_session()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    # -------------------------------------------------------------- generation

    async def agenerate(self, req: GenerationRequest) -> Completion:
        """Generate one completion; retries, fails over and resumes after aborts.

        Raises ``BadRequestError`` at once on a 4xx, ``GenerationError`` after
        ``request_retries`` failed retries, ``NoHealthyServerError`` when no
        server is in rotation.
        """
        t0 = time.perf_counter()
        prompt, budget = _check_request(req)
        sp = req.sampling
        base_params = sp.to_sglang()
        counters = self._counters
        counters["requests"] += 1
        retries_allowed = self.config.request_retries
        backoff = self.config.retry_backoff_s

        out_ids: list[int] = []
        out_lps: list[float] = []
        out_vers: list[int] = []
        n_aborts = empty_aborts = retries = segment = 0
        errors: list[str] = []  # one line per failed attempt, for the final error
        tried: set[str] = set()
        server: _Server | None = None  # kept across an abort: its prefix cache holds the prompt
        finish = "abort"

        while True:
            if not self._gate.is_set():
                await self._gate.wait()
            if not self._servers_running.is_set():
                await self._wait_for_continue(req.rid, server)
            if server is None or not server.healthy:
                # Sync fast path when everyone is healthy; the async path probes.
                server = None if self._n_unhealthy else self._choose(req.affinity_key, tried)
            if server is None:
                try:
                    server = await self._pick(req.affinity_key, tried)
                except NoHealthyServerError as e:
                    counters["failed"] += 1
                    history = f"; earlier attempts: {' | '.join(errors)}" if errors else ""
                    raise NoHealthyServerError(f"request {req.rid}: {e}{history}") from None
            if out_ids:
                payload = {
                    "input_ids": prompt + out_ids,
                    "sampling_params": {**base_params, "max_new_tokens": budget - len(out_ids)},
                    "return_logprob": True,
                    "rid": f"{req.rid}-{segment}",
                }
            else:
                payload = {
                    "input_ids": prompt,
                    "sampling_params": base_params,
                    "return_logprob": True,
                    "rid": req.rid if segment == 0 else f"{req.rid}-{segment}",
                }
            segment += 1
            try:
                result = await self._generate_once(server, payload)
            except _AttemptFailure as e:
                self._record_failure(server, e)
                errors.append(f"{server.addr}/generate: {e}")
                tried.add(server.addr)
                server = None
                if retries >= retries_allowed:
                    counters["failed"] += 1
                    raise GenerationError(
                        f"request {req.rid} failed after {retries} retr{'y' if retries == 1 else 'ies'} "
                        f"(request_retries={retries_allowed}): " + " | ".join(errors)
                    ) from None
                delay = backoff * (2**retries)
                retries += 1
                counters["retries"] += 1
                if delay > 0:
                    await asyncio.sleep(delay)
                continue
            except BadRequestError:
                counters["bad_requests"] += 1
                counters["failed"] += 1
                raise
            if result is None:
                # Not sent: the server left the rotation, or generation was paused, while the
                # request waited for a slot. No failed attempt; the loop re-routes or waits.
                segment -= 1
                continue

            ids, lps, finish, version = result
            if server.consecutive_failures:
                server.consecutive_failures = 0
            server.n_ok += 1
            if ids:
                out_ids += ids
                out_lps += lps
                out_vers += [version] * len(ids)
            if finish != "abort":
                break

            # Aborted (a weight update paused the server): resume where it stopped.
            n_aborts += 1
            counters["aborts"] += 1
            if len(out_ids) >= budget:
                finish = "length"
                break
            # The server stopped short of checking the last token. SGLang's check skips
            # stop_token_ids as well as EOS under ignore_eos (Req.check_finished), so do we.
            if ids and not sp.ignore_eos and (ids[-1] in self._eos_ids or ids[-1] in sp.stop_token_ids):
                finish = "stop"
                break
            if ids:
                empty_aborts = 0
            else:
                # No progress: not a retry (the budget is for faults), but bounded.
                empty_aborts += 1
                counters["empty_aborts"] += 1
                if empty_aborts > _MAX_EMPTY_ABORTS:
                    counters["failed"] += 1
                    raise GenerationError(
                        f"request {req.rid}: {server.addr}/generate aborted it {empty_aborts} times "
                        "in a row without producing a token; is the server stuck paused?"
                    )
                await asyncio.sleep(min(0.01 * 2 ** min(empty_aborts, 7), 1.0))

        counters["completed"] += 1
        counters["output_tokens"] += len(out_ids)
        if n_aborts:
            counters["interrupted_requests"] += 1
        return Completion(
            rid=req.rid,
            input_ids=prompt,
            output_ids=out_ids,
            output_logprobs=out_lps,
            output_versions=out_vers,
            finish_reason=finish,
            latency_s=time.perf_counter() - t0,
            server=server.addr,
            n_interruptions=n_aborts,
        )

    async def _generate_once(
        self, server: _Server, payload: dict[str, Any]
    ) -> tuple[list[int], list[float], str, int] | None:
        """One POST /generate; returns (ids, logprobs, finish reason, version).

        Returns None without sending when, by the time the request has a slot on
        ``server``, the server left the rotation or generation is paused.
        """
        session = self._session or self._ensure_session()
        try:
            body = _dumps(payload)
        except TypeError as e:  # e.g. a numpy integer inside input_ids
            raise ValueError(
                f"request {payload['rid']}: GenerationRequest.input_ids must hold Python ints "
                f"(convert with .tolist()): {e}"
            ) from None
        # Registered while queued for a slot too, so that taking the server out wakes it.
        att = _Attempt(asyncio.current_task())
        server.attempts.add(att)
        sent = False
        try:
            async with server.sem:
                if not server.healthy or not self._servers_running.is_set():
                    return None
                sent = True
                server.inflight += 1
                try:
                    if server.pool is not None:
                        status, raw = await server.pool.post("/generate", body, self.config.request_timeout_s)
                    else:
                        async with session.post(
                            server.base_url + "/generate", data=body, headers=_JSON_HEADERS,
                            timeout=self._req_timeout,
                        ) as resp:
                            raw = await resp.read()
                            status = resp.status
                finally:
                    server.inflight -= 1
        except asyncio.CancelledError:
            # Our own eviction (_take_out) rather than the caller cancelling?
            if att.evicted is not None and att.task is not None and att.task.uncancel() == 0:
                if not sent:
                    return None
                raise _AttemptFailure("evicted", f"server left the rotation ({att.evicted})") from None
            raise
        except TimeoutError:
            raise _AttemptFailure(
                "timeout", f"no answer within request_timeout_s={self.config.request_timeout_s:g}s"
            ) from None
        except (aiohttp.ClientError, HttpConnectionError, HttpProtocolError) as e:
            raise _AttemptFailure("connection", _describe(e)) from None
        finally:
            server.attempts.discard(att)
        if status != 200:
            if status >= 500 or status in _RETRYABLE_4XX:
                raise _AttemptFailure("http_5xx", f"HTTP {status}: {_snippet(raw)}")
            raise BadRequestError(server.addr, "/generate", status, _error_message(raw))
        return self._parse_generate(raw)

    async def _wait_for_continue(self, rid: str, server: _Server | None) -> None:
        """Hold a (re)submission until ``continue_generation``, at most ``max_pause_s``
        after ``pause_generation``."""
        left = self._paused_at + self._max_pause_s - time.monotonic()
        try:
            await asyncio.wait_for(self._servers_running.wait(), max(left, 0.0))
        except TimeoutError:
            self._counters["failed"] += 1
            where = server.addr if server is not None else ", ".join(self.healthy_servers)
            raise GenerationError(
                f"request {rid}: inference server(s) {where} paused by pause_generation "
                f"{time.monotonic() - self._paused_at:.0f}s ago and not continued within "
                f"max_pause_s={self._max_pause_s:g}s; did the weight update fail before "
                "continue_generation?"
            ) from None

    def _parse_generate(self, raw: bytes) -> tuple[list[int], list[float], str, int]:
        try:
            data = _loads(raw)
        except ValueError as e:
            raise _AttemptFailure("malformed", f"response is not JSON ({e}): {_snippet(raw)}") from None
        if isinstance(data, list) and len(data) == 1:
            data = data[0]
        if not isinstance(data, dict):
            raise _AttemptFailure("malformed", f"response is {type(data).__name__}, not an object: {_snippet(raw)}")
        meta = data.get("meta_info")
        if not isinstance(meta, dict):
            raise _AttemptFailure("malformed", f"response has no 'meta_info' object: {_snippet(raw)}")
        fr = meta.get("finish_reason")
        finish = fr.get("type") if isinstance(fr, dict) else fr
        if finish not in _FINISH_REASONS:
            raise _AttemptFailure(
                "malformed", f"meta_info.finish_reason is {fr!r}; expected type stop, length or abort"
            )
        token_lps = meta.get("output_token_logprobs")
        if not isinstance(token_lps, list):
            raise _AttemptFailure(
                "malformed", "meta_info.output_token_logprobs is missing (was return_logprob honoured?)"
            )
        if token_lps:
            # Column split in C: entries are [logprob, token_id, text-or-null].
            try:
                cols = list(zip(*token_lps))
                lps, lp_ids = list(cols[0]), list(cols[1])
            except (TypeError, IndexError):
                lps = lp_ids = None
            if lps is None or len(lps) != len(token_lps) or None in lps:
                raise _AttemptFailure(
                    "malformed", "meta_info.output_token_logprobs entries are not [logprob, token_id, ...]"
                )
        else:
            lps, lp_ids = [], []
        ids = data.get("output_ids")
        if ids is None:
            ids = lp_ids
        elif ids != lp_ids:
            raise _AttemptFailure(
                "malformed",
                f"output_ids ({_count(ids)} tokens) disagree with meta_info.output_token_logprobs "
                f"({len(lp_ids)} tokens)",
            )
        if ids and (type(ids[0]) is not int or type(lps[0]) not in (float, int)):
            raise _AttemptFailure(
                "malformed", f"output tokens/logprobs have types {type(ids[0]).__name__}/"
                f"{type(lps[0]).__name__}, expected int/float"
            )
        return ids, lps, finish, self._segment_version(meta.get("weight_version"))

    def _segment_version(self, wv: Any) -> int:
        if type(wv) is int:
            return wv
        if isinstance(wv, str):
            try:
                return int(wv)
            except ValueError:
                pass
        # SGLang reports "default" until the first update_weight_version; fall back to
        # the client's version (counted, so a server that never reports one shows up).
        self._counters["version_fallbacks"] += 1
        return self._version

    # ---------------------------------------------------------------- routing

    async def _pick(self, key: Any, exclude: set[str]) -> _Server:
        if self._n_unhealthy:
            self._schedule_probes()
        s = self._choose(key, exclude)
        if s is None:
            # Nobody is in rotation: probe everyone now rather than fail on stale news.
            await asyncio.gather(
                *(self._probe(x) for x in self._servers if not x.healthy and x.excluded is None)
            )
            s = self._choose(key, exclude)
            if s is None:
                detail = "; ".join(f"{x.addr}: {x.excluded or x.reason}" for x in self._servers)
                raise NoHealthyServerError(f"no healthy inference server ({detail})")
        return s

    def _choose(self, key: Any, exclude: set[str]) -> _Server | None:
        """Affinity first; else round-robin, preferring a server with a free slot."""
        owner = None
        if key is not None:
            addr = self._affinity.get(key)
            if addr is not None:
                owner = self._by_addr[addr]
                if owner.healthy and addr not in exclude:
                    self._affinity.move_to_end(key)
                    return owner
        servers = self._servers
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
                return self._choose(key, set())
            return None
        # A retry after a one-off failure moves only this attempt; a key whose server
        # left the rotation moves for good.
        if key is not None and (owner is None or not owner.healthy):
            self._affinity[key] = best.addr
            self._affinity.move_to_end(key)
            if len(self._affinity) > _AFFINITY_CACHE:
                self._affinity.popitem(last=False)
        return best

    def _record_failure(self, s: _Server, e: _AttemptFailure) -> None:
        kind = e.kind
        counter = {"http_5xx": "http_5xx", "timeout": "timeouts", "connection": "connection_errors",
                   "malformed": "malformed", "evicted": "evicted"}[kind]
        self._counters[counter] += 1
        s.n_failed += 1
        if kind == "evicted":
            return  # the server is already out; the attempt did nothing wrong
        s.consecutive_failures += 1
        logger.warning("%s/generate failed (%s): %s", s.addr, kind, e)
        if s.healthy and s.consecutive_failures >= self._unhealthy_after:
            self._take_out(s, f"{s.consecutive_failures} consecutive failures, last: {e}")

    def _take_out(self, s: _Server, reason: str) -> None:
        if s.healthy:
            s.healthy = False
            self._n_unhealthy += 1
            self._counters["marked_unhealthy"] += 1
            s.last_probe = time.monotonic()
            logger.warning("inference server %s leaves the rotation: %s", s.addr, reason)
        s.reason = reason
        for att in list(s.attempts):
            if att.evicted is None and att.task is not None and not att.task.done():
                att.evicted = reason
                att.task.cancel()

    def _bring_back(self, s: _Server) -> None:
        if not s.healthy and s.excluded is None:
            s.healthy = True
            s.reason = ""
            s.consecutive_failures = 0
            self._n_unhealthy -= 1
            self._counters["recovered"] += 1
            logger.warning("inference server %s is back in rotation", s.addr)

    def _schedule_probes(self) -> None:
        now = time.monotonic()
        for s in self._servers:
            if (not s.healthy and s.excluded is None and not s.probing
                    and now - s.last_probe >= self._probe_interval):
                t = asyncio.get_running_loop().create_task(self._probe(s))
                self._bg_tasks.add(t)
                t.add_done_callback(self._bg_tasks.discard)

    async def _probe(self, s: _Server) -> bool:
        """GET /health once; a server that answers 200 comes back into rotation."""
        if s.probing:
            return False
        s.probing = True
        s.last_probe = time.monotonic()
        try:
            async with self._ensure_session().get(s.base_url + "/health", timeout=self._probe_timeout) as r:
                await r.read()
                ok = r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        finally:
            s.probing = False
        if ok:
            self._bring_back(s)
        return ok

    # ------------------------------------------------------------------ admin

    async def _admin(
        self,
        route: str,
        payload: dict[str, Any] | None = None,
        *,
        servers: list[_Server] | None = None,
        per_server: Callable[[int, _Server], dict[str, Any]] | None = None,
        timeout: float | None = None,
        method: str = "POST",
    ) -> dict[str, Any]:
        """Send one admin call to every target server concurrently; raise naming failures."""
        session = self._ensure_session()
        targets = servers if servers is not None else [s for s in self._servers if s.healthy]
        if not targets:
            detail = "; ".join(f"{x.addr}: {x.excluded or x.reason}" for x in self._servers)
            raise NoHealthyServerError(f"{route}: no healthy inference server ({detail})")
        t = aiohttp.ClientTimeout(total=timeout if timeout is not None else self.config.request_timeout_s)

        async def one(i: int, s: _Server) -> tuple[Any, str | None]:
            body = per_server(i, s) if per_server is not None else payload
            try:
                async with session.request(
                    method, s.base_url + route,
                    data=_dumps(body) if body is not None else None,
                    headers=_JSON_HEADERS if body is not None else None,
                    timeout=t,
                ) as resp:
                    raw = await resp.read()
                    status = resp.status
            except TimeoutError:
                self._record_admin_fault(s)
                return None, f"no answer within {t.total:g}s"
            except aiohttp.ClientError as e:
                self._record_admin_fault(s)
                return None, _describe(e)
            try:
                result: Any = _loads(raw) if raw else None
            except ValueError:
                result = raw.decode("utf-8", "replace")
            if status != 200:
                return result, f"HTTP {status}: {_error_message(raw)}"
            if isinstance(result, dict) and result.get("success") is False:
                return result, f"success false: {result.get('message', '(no message)')}"
            return result, None

        answers = await asyncio.gather(*(one(i, s) for i, s in enumerate(targets)))
        results = {s.addr: r for s, (r, err) in zip(targets, answers) if err is None}
        failures = {s.addr: err for s, (r, err) in zip(targets, answers) if err is not None}
        if failures:
            raise ServerAdminError(route, failures, results)
        return results

    def _record_admin_fault(self, s: _Server) -> None:
        # A dead server should not fail every later admin call forever: count it.
        s.consecutive_failures += 1
        if s.healthy and s.consecutive_failures >= self._unhealthy_after:
            self._take_out(s, f"{s.consecutive_failures} consecutive failures (admin calls)")

    def _exclude_unhealthy(self, why: str) -> None:
        """Servers out of rotation miss a weight update: keep them out for good."""
        for s in self._servers:
            if not s.healthy and s.excluded is None:
                s.excluded = why
                logger.warning("%s missed %s; it stays out of rotation", s.addr, why)

    async def pause_generation(self) -> dict[str, Any]:
        """Pause every server: in-flight requests return with finish reason ``abort``.

        Until ``continue_generation``, their resubmissions and new requests wait in
        this client (at most ``max_pause_s``), not on the servers.
        """
        if self._servers_running.is_set():
            self._paused_at = time.monotonic()
            self._servers_running.clear()
        return await self._admin("/pause_generation", {"mode": "abort"})

    async def continue_generation(self) -> dict[str, Any]:
        """Resume generation on every server after ``pause_generation``; held requests go out."""
        try:
            return await self._admin("/continue_generation", {})
        finally:
            # Even after a failure: a server still paused holds its requests, as without the
            # client's pause, and the fault handling moves them.
            self._servers_running.set()

    async def flush_cache(self) -> dict[str, Any]:
        """Drop every server's prefix (KV) cache."""
        return await self._admin("/flush_cache", {})

    async def update_weights_from_disk(
        self, path: str, version: int, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """Load an HF-format directory on every healthy server, tagged ``version``."""
        self._exclude_unhealthy(f"the weight update to version {version}")
        out = await self._admin(
            "/update_weights_from_disk",
            {"model_path": str(path), "weight_version": str(int(version))},
            timeout=timeout,
        )
        self._version = int(version)
        return out

    async def update_weights_from_shm(
        self,
        path: str,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Sequence[int]],
        offsets: Sequence[int],
        version: int,
        *,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Load every weight from a shared-memory file on every healthy server, tagged ``version``.

        Tensor ``names[i]`` lies at byte ``offsets[i]`` of ``path`` with ``dtypes[i]``
        (torch dtypes or strings) and ``shapes[i]``. Embedded servers on this host only.
        """
        route = "/update_weights_from_shm"
        if not len(names) == len(dtypes) == len(shapes) == len(offsets):
            raise ValueError(
                f"{route}: names ({len(names)}), dtypes ({len(dtypes)}), shapes ({len(shapes)}) "
                f"and offsets ({len(offsets)}) must have the same length"
            )
        self._exclude_unhealthy(f"the weight update to version {version}")
        out = await self._admin(route, {
            "path": str(path),
            "names": list(names),
            "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [[int(x) for x in shp] for shp in shapes],
            "offsets": [int(o) for o in offsets],
            "weight_version": str(int(version)),
        }, timeout=timeout)
        self._version = int(version)
        return out

    def weights_update_world_size(self) -> int:
        """World size of a weight-update group over the healthy servers (+1 trainer rank)."""
        return 1 + sum(s.tp_size for s in self._servers if s.healthy)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int | None = None,
        group_name: str = "arealite_weights",
        backend: str = "gloo",
        *,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Ask every healthy server to join the trainer's weight-update group.

        Rank 0 is the trainer; server i gets ``rank_offset`` 1 + the ranks of the
        servers before it (its ``tp_size`` from ``/get_server_info``, 1 by
        default). The call blocks until the rendezvous: run it as a task while
        the trainer joins the group.
        """
        members = [s for s in self._servers if s.healthy]
        expected = 1 + sum(s.tp_size for s in members)
        if world_size is None:
            world_size = expected
        elif int(world_size) != expected:
            raise ValueError(
                f"init_weights_update_group: world_size={world_size}, but the "
                f"{len(members)} healthy server(s) hold {expected - 1} rank(s) plus 1 trainer "
                f"rank = {expected}; pass world_size={expected} (or None)"
            )
        offsets, nxt = [], 1
        for s in members:
            offsets.append(nxt)
            nxt += s.tp_size
        self._exclude_unhealthy(f"weight-update group {group_name!r}")
        self._groups[group_name] = [s.addr for s in members]
        return await self._admin(
            "/init_weights_update_group",
            servers=members,
            per_server=lambda i, s: {
                "master_address": master_address,
                "master_port": int(master_port),
                "rank_offset": offsets[i],
                "world_size": int(world_size),
                "group_name": group_name,
                "backend": backend,
            },
            timeout=timeout,
        )

    def _group_members(self, group_name: str, route: str) -> list[_Server]:
        if group_name not in self._groups:
            raise ValueError(
                f"{route}: unknown weight-update group {group_name!r} "
                f"(known: {sorted(self._groups)}); call init_weights_update_group first"
            )
        members = [self._by_addr[a] for a in self._groups[group_name]]
        gone = [s for s in members if not s.healthy]
        if gone:
            # A collective with a dead member would hang: fail clearly instead.
            raise ServerAdminError(
                route, {s.addr: f"out of rotation ({s.reason}); group {group_name!r} is broken, "
                        "destroy and re-create it" for s in gone}, {},
            )
        return members

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[Any],
        shapes: Sequence[Sequence[int]],
        group_name: str = "arealite_weights",
        version: int | None = None,
        flattened_bucket: bool = False,
        *,
        flush_cache: bool = True,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Tell every group member to receive the tensors ``names`` (broadcast from rank 0).

        ``dtypes`` may be torch dtypes or strings ("bfloat16"). Post this while
        the trainer broadcasts, in ``names`` order.
        """
        route = "/update_weights_from_distributed"
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(
                f"{route}: names ({len(names)}), dtypes ({len(dtypes)}) and shapes "
                f"({len(shapes)}) must have the same length"
            )
        members = self._group_members(group_name, route)
        payload: dict[str, Any] = {
            "names": list(names),
            "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [[int(x) for x in shp] for shp in shapes],
            "group_name": group_name,
            "flush_cache": bool(flush_cache),
        }
        if version is not None:
            payload["weight_version"] = str(int(version))
        if flattened_bucket:
            payload["load_format"] = "flattened_bucket"
        out = await self._admin(route, payload, servers=members, timeout=timeout)
        if version is not None:
            self._version = int(version)
        return out

    async def begin_weight_update(self) -> dict[str, Any]:
        """``/begin_weight_update`` on the servers that have it (SGLang >= 0.5.21); others skip."""
        return await self._bracket("/begin_weight_update")

    async def end_weight_update(self) -> dict[str, Any]:
        """``/end_weight_update`` on the servers that have it (SGLang >= 0.5.21); others skip."""
        return await self._bracket("/end_weight_update")

    def supports_weight_update_brackets(self, addr: str) -> bool:
        """Whether a server's release has begin/end_weight_update."""
        v = self._server(addr).version
        return v is not None and v >= (*WEIGHT_UPDATE_BRACKETS_SINCE, 0)

    async def _bracket(self, route: str) -> dict[str, Any]:
        targets = [s for s in self._servers if s.healthy and self.supports_weight_update_brackets(s.addr)]
        if not targets:
            return {}
        return await self._admin(route, {}, servers=targets)

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> dict[str, Any]:
        """Read a weight back from every healthy server: {addr: values (truncated)}."""
        return await self._admin(
            "/get_weights_by_name", {"name": name, "truncate_size": int(truncate_size)}
        )

    async def update_weight_version(self, version: int) -> dict[str, Any]:
        """Set the ``weight_version`` every healthy server reports."""
        self._exclude_unhealthy(f"the version update to {version}")
        out = await self._admin(
            "/update_weight_version", {"new_version": str(int(version)), "abort_all_requests": False}
        )
        self._version = int(version)
        return out

    async def destroy_weights_update_group(self, group_name: str = "arealite_weights") -> dict[str, Any]:
        """Tear down a weight-update group on its (healthy) members."""
        addrs = self._groups.pop(group_name, None)
        if addrs is None:
            raise ValueError(f"destroy_weights_update_group: unknown group {group_name!r} (known: {sorted(self._groups)})")
        members = [self._by_addr[a] for a in addrs if self._by_addr[a].healthy]
        if not members:
            return {}
        return await self._admin("/destroy_weights_update_group", {"group_name": group_name}, servers=members)

    # ---------------------------------------------------------------- helpers

    def _server(self, addr: str) -> _Server:
        key, _ = _normalize_addr(addr)
        if key not in self._by_addr:
            raise ValueError(f"unknown server {addr!r}; known servers: {self.servers}")
        return self._by_addr[key]

    def _on_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine's loop (pause/resume may come from the trainer thread)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if self._loop is None or running is self._loop or self._loop.is_closed():
            fn()
        else:
            self._loop.call_soon_threadsafe(fn)


# ---------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------


def _check_request(req: GenerationRequest) -> tuple[list[int], int]:
    """Validate at the boundary: a bad request fails here, not on the server."""
    if not isinstance(req, GenerationRequest):
        raise TypeError(f"agenerate expects a GenerationRequest, got {type(req).__name__}")
    ids = req.input_ids
    # Fast path (the usual case): a list of Python ints; the ends are checked here and the
    # serializer rejects any other non-number in between.
    if type(ids) is list and ids and type(ids[0]) is int and type(ids[-1]) is int:
        prompt = list(ids)
    else:
        try:
            prompt = [int(t) for t in ids]
        except (TypeError, ValueError):
            raise ValueError(
                f"GenerationRequest.input_ids must be a list of token ids (ints), got {ids!r:.80}"
            ) from None
        if not prompt:
            raise ValueError(
                f"GenerationRequest.input_ids of request {req.rid} is empty; give at least one token"
            )
    budget = req.sampling.max_new_tokens
    if type(budget) is not int or budget < 1:
        raise ValueError(
            f"SamplingParams.max_new_tokens={budget!r} of request {req.rid} must be an int >= 1"
        )
    return prompt, budget


def _describe(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _snippet(raw: bytes, n: int = 200) -> str:
    text = raw[:n].decode("utf-8", "replace")
    return repr(text) + ("..." if len(raw) > n else "")


def _count(x: Any) -> Any:
    return len(x) if isinstance(x, list) else type(x).__name__


def _error_message(raw: bytes) -> str:
    """The server's own words: SGLang puts them in {"error": {"message"}} or {"message"}."""
    try:
        data = _loads(raw)
    except ValueError:
        return raw[:500].decode("utf-8", "replace")
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if key in data:
                return str(data[key])
    return raw[:500].decode("utf-8", "replace")
