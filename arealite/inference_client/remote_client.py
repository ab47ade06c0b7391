"""The inference client core: generation over HTTP, whatever the backend.

`RemoteInferenceClient` turns a ``GenerationRequest`` into a ``Completion`` on one
of several inference servers and hides what goes wrong on the way. The backend's
wire format (request body, answer, self-description) is a `WireFormat`
(`sglang_wire.SGLangWire` for SGLang and the embedded server); the servers'
administration (pause, weight updates) is another object over the same
`ServerPool` (`sglang_admin.SGLangAdmin`).

- **Routing**: round-robin over healthy servers, with affinity: requests that
  share ``affinity_key`` (the samples of a group, the turns of a conversation)
  go to the same server, so its prefix cache is reused. If that server leaves
  the rotation, the key moves to another one.
- **Back-pressure**: at most ``max_inflight_per_server`` requests per server;
  the others queue for a slot (and move at once if the server leaves the rotation).
- **Interruptible generation**: a weight update pauses the servers, which
  return in-flight requests with finish reason ``abort`` and their partial
  output. The client resubmits prompt + partial output with a lower
  ``max_new_tokens``; every token keeps the weight version of the response
  segment that produced it, so the completion is seamless. While the servers are
  paused through the admin, the client itself holds resubmissions and new
  submissions (rather than the paused server, against their request timeout).
- **Faults**: timeouts, connection errors, HTTP 5xx and malformed responses are
  retried with exponential backoff on another healthy server; a server that
  fails several times in a row leaves the rotation until a health probe
  brings it back. A 4xx is the caller's fault and is raised at once.

All coroutines run on one event loop (the rollout controller's, uvloop).
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from collections.abc import Callable, Iterable, Sequence
import aiohttp

from arealite.api.types import Completion, GenerationRequest
from arealite.config.schema import RolloutConfig
from arealite.inference_client.errors import AttemptFailure, BadRequestError, GenerationError, NoHealthyServerError
from arealite.inference_client.http1 import HttpConnectionError, HttpProtocolError, HttpResponseTooLarge
from arealite.inference_client.response_check import check_segment
from arealite.inference_client.moe_routing import RoutingRows
from arealite.inference_client.server_pool import Attempt, Router, ServerPool, ServerPoolView, ServerState, read_body
from arealite.inference_client.coalesce import RequestBatcher, SharedFailure, retryable_status
from arealite.inference_client.wire import JSON_HEADERS, Segment, WireFormat, describe, encode_request, error_message, snippet
from arealite.utils.json_types import JsonObject

logger = logging.getLogger(__name__)

__all__ = ["RemoteInferenceClient"]

# A server that keeps aborting a request before it produced a single token is
# broken, not paused (a paused server holds new requests): give up after this many.
_MAX_EMPTY_ABORTS = 100
_COUNTERS = (
    "requests", "completed", "failed", "bad_requests", "retries", "timeouts",
    "connection_errors", "http_5xx", "malformed", "evicted", "aborts",
    "empty_aborts", "interrupted_requests", "output_tokens", "marked_unhealthy",
    "recovered", "version_fallbacks",
)
_FAILURE_COUNTER = {"http_5xx": "http_5xx", "timeout": "timeouts", "connection": "connection_errors",
                    "malformed": "malformed", "evicted": "evicted"}


class _Progress:
    """One request across its attempts (retries) and segments (resubmissions after aborts)."""

    __slots__ = ("req", "t0", "prompt", "budget", "params", "ids", "lps", "vers", "n_aborts",
                 "empty_aborts", "retries", "segment", "errors", "tried", "server", "finish", "top", "routing")

    def __init__(self, req: GenerationRequest, prompt: list[int], budget: int, params: JsonObject):
        self.req, self.prompt, self.budget, self.params = req, prompt, budget, params
        self.t0 = time.perf_counter()
        self.ids: list[int] = []
        self.lps: list[float] = []
        self.vers: list[int] = []
        self.top: list[list[tuple[int, float]]] | None = [] if req.top_logprobs else None
        self.routing = RoutingRows()  # the server's routed experts, when it reports them
        self.n_aborts = self.empty_aborts = self.retries = self.segment = 0
        self.errors: list[str] = []  # one line per failed attempt, for the final error
        self.tried: set[str] = set()
        self.server: ServerState | None = None  # kept across an abort: its prefix cache holds the prompt
        self.finish = "abort"


class RemoteInferenceClient(ServerPoolView):
    """Generation on inference servers over HTTP (implements ``InferenceClient``).

    ``addrs`` are "host:port" (or "http://host:port"). ``wire`` is the backend's wire
    format. ``api_key`` is sent as ``Authorization: Bearer <key>`` on every request and
    never logged. ``eos_token_ids`` (optional) are treated as stop tokens when an aborted
    segment ends on one. Every answer is checked before its tokens are kept
    (`arealite.inference_client.response_check`: ids ints within ``vocab_size``, at most the budget,
    finite log-probs <= 0, a body of at most ``rollout.max_response_bytes``); one that
    fails is a malformed answer, retried on another server. A server leaves the rotation after ``unhealthy_after``
    consecutive failures and is probed every ``health_probe_interval_s`` seconds to come
    back. Requests held by the servers' pause fail once it has lasted ``max_pause_s``
    seconds (a weight update that died half-way).
    """

    def __init__(self, addrs: Sequence[str] | str, config: RolloutConfig | None = None,
                 api_key: str | None = None, *, wire: WireFormat, eos_token_ids: Iterable[int] = (),
                 unhealthy_after: int = 3, health_probe_interval_s: float = 5.0,
                 max_pause_s: float = 3600.0, vocab_size: int | None = None):
        self.config = config if config is not None else RolloutConfig()
        self.pool = ServerPool(addrs, wire=wire, max_inflight=self.config.max_inflight_per_server,
                               request_timeout_s=self.config.request_timeout_s, api_key=api_key,
                               unhealthy_after=unhealthy_after, probe_interval_s=health_probe_interval_s,
                               owner=type(self).__name__, max_response_bytes=self.config.max_response_bytes)
        if vocab_size is not None and not (type(vocab_size) is int and vocab_size >= 1):
            raise ValueError(f"vocab_size={vocab_size!r} must be an int >= 1 (the model's vocabulary) or None")
        self.vocab_size = vocab_size
        if not max_pause_s > 0:
            raise ValueError(f"max_pause_s={max_pause_s} must be > 0 (seconds)")
        self.wire = wire
        self._router = Router(self.pool)
        self._eos_ids = frozenset(int(t) for t in eos_token_ids)
        self._req_timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
        self._max_pause_s = float(max_pause_s)
        self._gate = asyncio.Event()  # the client's own pause gate (set = running)
        self._gate.set()
        self._version = 0
        self._counters = dict.fromkeys(_COUNTERS, 0)
        can_batch = self.config.batch_requests and getattr(wire, "batches", False)
        self._batcher = RequestBatcher(wire, self.pool.max_response_bytes) if can_batch else None

    # ------------------------------------------------------------------ state
    # (servers, healthy_servers, server_info, out_of_rotation, drop_unreachable: `ServerPoolView`)

    def get_version(self) -> int:
        """The client's view of the current policy version (for stats and fallbacks)."""
        return self._version

    def set_version(self, version: int) -> None:
        """Set the client's view of the current policy version."""
        self._version = int(version)

    def server_version(self, addr: str) -> str | None:
        """The release string a server reported at ``initialize()`` (None if unknown)."""
        return self.pool.get(addr).version_text

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

    def stats(self) -> JsonObject:
        """Counters (requests, retries, failures by cause, aborts ...) and per-server state."""
        out: JsonObject = dict(self._counters)
        out.update(self.pool.counts)
        if self._batcher is not None:
            out.update(self._batcher.counts)
        out["version"] = self._version
        out["n_healthy"] = len(self.pool.states) - self.pool.n_unhealthy
        out["servers"] = {
            s.addr: {"healthy": s.healthy, "reason": s.reason, "excluded": s.excluded,
                     "inflight": s.inflight, "completed": s.n_ok, "failed": s.n_failed,
                     "release": s.version_text}
            for s in self.pool.states
        }
        return out

    def mark_unhealthy(self, addr: str, reason: str) -> None:
        """Take a server out of rotation; its in-flight and queued requests move to other servers."""
        self.pool.take_out(self.pool.get(addr), reason)

    # --------------------------------------------------------------- lifecycle

    async def initialize(self, timeout: float = 300.0) -> None:
        """Wait until every server answers its health route (at most ``timeout`` s), then
        read what it says about itself (release, tp_size). Raises ``ServerStartupError``
        naming the servers that never answered and why."""
        await self.pool.initialize(timeout)

    async def aclose(self) -> None:
        """Close the HTTP session and stop background health probes."""
        await self.pool.aclose()

    async def __aenter__(self):
        self.pool.ensure_session()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _on_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the client's loop (pause/resume may come from the trainer thread)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        loop = self.pool.loop
        if loop is None or running is loop or loop.is_closed():
            fn()
        else:
            loop.call_soon_threadsafe(fn)

    # -------------------------------------------------------------- generation

    async def agenerate(self, req: GenerationRequest) -> Completion:
        """Generate one completion; retries, fails over and resumes after aborts.

        Raises ``BadRequestError`` at once on a 4xx, ``GenerationError`` after
        ``request_retries`` failed retries, ``NoHealthyServerError`` when no
        server is in rotation.
        """
        prompt, budget = _check_request(req)
        p = _Progress(req, prompt, budget, self.wire.sampling_params(req.sampling))
        self._counters["requests"] += 1
        while True:
            # Each step is a call only when it has work to do: this loop carries every
            # request of the run on the controller's one thread.
            if not (self._gate.is_set() and self.pool.running.is_set()):
                await self._wait_for_gates(p)
            if p.server is None or not p.server.healthy:
                await self._route(p)
            try:
                seg = await self._generate_once(p.server, self._next_body(p), p.req.affinity_key)
                if seg is not None:
                    check_segment(seg, p.budget - len(p.ids), self.vocab_size)
                    if p.top is not None and seg.ids and seg.top is None:
                        raise AttemptFailure("malformed", "top log-probs were asked for and not given")
            except AttemptFailure as e:
                await self._after_failure(p, e)
                continue
            except BadRequestError:
                self._counters["bad_requests"] += 1
                self._counters["failed"] += 1
                raise
            if seg is None:
                # Not sent: the server left the rotation, or generation was paused, while the
                # request waited for a slot. No failed attempt; the loop re-routes or waits.
                p.segment -= 1
                continue
            self._take(p, seg)
            if seg.finish != "abort" or await self._finished_after_abort(p, seg):
                return self._complete(p)

    async def _wait_for_gates(self, p: _Progress) -> None:
        """Hold the (re)submission while the client or the servers are paused."""
        if not self._gate.is_set():
            await self._gate.wait()
        if not self.pool.running.is_set():
            await self._wait_for_continue(p.req.rid, p.server)

    async def _route(self, p: _Progress) -> None:
        """Pick a server: the request keeps its own while it is healthy (its prefix cache)."""
        # Sync fast path when everyone is healthy; the async path probes.
        p.server = None if self.pool.n_unhealthy else self._router.choose(p.req.affinity_key, p.tried)
        if p.server is None:
            try:
                p.server = await self._router.pick(p.req.affinity_key, p.tried)
            except NoHealthyServerError as e:
                self._counters["failed"] += 1
                history = f"; earlier attempts: {' | '.join(p.errors)}" if p.errors else ""
                raise NoHealthyServerError(f"request {p.req.rid}: {e}{history}") from None

    def _next_body(self, p: _Progress) -> JsonObject:
        """The next segment's request: the prompt plus what was generated so far."""
        rid = p.req.rid
        top = p.req.top_logprobs
        if p.ids:
            body = self.wire.generate_body(p.prompt + p.ids, p.params, f"{rid}-{p.segment}",
                                           p.budget - len(p.ids), top_logprobs=top)
        else:
            body = self.wire.generate_body(p.prompt, p.params, rid if p.segment == 0 else f"{rid}-{p.segment}",
                                           top_logprobs=top)
        if p.req.image_data:  # every segment carries the images: a continuation re-reads the prompt
            body["image_data"] = list(p.req.image_data)
        p.segment += 1
        return body

    async def _after_failure(self, p: _Progress, e: AttemptFailure) -> None:
        """Count a failed attempt; raise when the retry budget is spent, else back off."""
        server = p.server
        self._record_failure(server, e)
        p.errors.append(f"{server.addr}{self.wire.generate_route} ({e.kind}): {e}")
        p.tried.add(server.addr)
        p.server = None
        allowed = self.config.request_retries
        if p.retries >= allowed:
            self._counters["failed"] += 1
            raise GenerationError(
                f"request {p.req.rid} failed after {p.retries} retr{'y' if p.retries == 1 else 'ies'} "
                f"(request_retries={allowed}): " + " | ".join(p.errors)
            ) from None
        delay = self.config.retry_backoff_s * (2**p.retries)
        p.retries += 1
        self._counters["retries"] += 1
        if delay > 0:
            await asyncio.sleep(delay)

    @staticmethod
    def _take(p: _Progress, seg: Segment) -> None:
        """Append a segment's tokens, each tagged with the version that sampled it."""
        server = p.server
        if server.consecutive_failures:
            server.consecutive_failures = 0
        server.n_ok += 1
        ids = seg.ids
        if ids:
            p.ids += ids
            p.lps += seg.logprobs
            # Each token keeps the version that sampled it (several when the weights changed under it).
            p.vers += seg.versions if seg.versions is not None else [seg.version] * len(ids)
            if p.top is not None:
                p.top += seg.top
            on_segment = p.req.metadata.get("on_segment") if p.req.metadata else None
            if on_segment is not None:  # e.g. the agent endpoint streaming a reply as it comes
                on_segment(ids)
        if seg.routed_experts is not None:
            p.routing.extend(seg.routed_experts, len(p.prompt) + len(p.ids) - 1)
        p.finish = seg.finish

    async def _finished_after_abort(self, p: _Progress, seg: Segment) -> bool:
        """An aborted segment (a weight update paused the server): True when the completion
        is nevertheless finished, else the request resumes where it stopped."""
        p.n_aborts += 1
        self._counters["aborts"] += 1
        if len(p.ids) >= p.budget:
            p.finish = "length"
            return True
        # The server stopped short of checking the last token. SGLang's check skips
        # stop_token_ids as well as EOS under ignore_eos (Req.check_finished), so do we.
        ids, sp = seg.ids, p.req.sampling
        if ids and not sp.ignore_eos and (ids[-1] in self._eos_ids or ids[-1] in sp.stop_token_ids):
            p.finish = "stop"
            return True
        if ids:
            p.empty_aborts = 0
            return False
        self._counters["empty_aborts"] += 1
        if self.paused:
            # Our own weight update: the pause aborts waiting requests too (SGLang's abort
            # mode), and the gate holds this one until the update is done.
            return False
        # No progress and no pause of ours: not a retry (the budget is for faults), but bounded.
        p.empty_aborts += 1
        if p.empty_aborts > _MAX_EMPTY_ABORTS:
            self._counters["failed"] += 1
            raise GenerationError(
                f"request {p.req.rid}: {p.server.addr}{self.wire.generate_route} aborted it "
                f"{p.empty_aborts} times in a row without producing a token; is the server stuck paused?"
            )
        await asyncio.sleep(min(0.01 * 2 ** min(p.empty_aborts, 7), 1.0))
        return False

    def _complete(self, p: _Progress) -> Completion:
        c = self._counters
        c["completed"] += 1
        c["output_tokens"] += len(p.ids)
        if p.n_aborts:
            c["interrupted_requests"] += 1
        return Completion(rid=p.req.rid, input_ids=p.prompt, output_ids=p.ids, output_logprobs=p.lps,
                          output_versions=p.vers, finish_reason=p.finish,
                          latency_s=time.perf_counter() - p.t0, server=p.server.addr,
                          n_interruptions=p.n_aborts, output_top_logprobs=p.top, routed_experts=p.routing.rows())

    async def _generate_once(self, server: ServerState, payload: JsonObject, key: str | None) -> Segment | None:
        """One generation call; returns the segment with its version filled in.

        Returns None without sending when, by the time the request has a slot on
        ``server``, the server left the rotation or generation is paused (by the servers or
        this client). With a ``key`` (the request's affinity), the call joins the requests of
        that key leaving in the same turn of the loop in one batched exchange (`coalesce`).
        """
        # Registered while queued for a slot too, so that taking the server out wakes it.
        att = Attempt(asyncio.current_task())
        server.attempts.add(att)
        sent = False
        try:
            async with server.sem:
                # Re-checked once a slot is ours: the wait for it may have outlasted a pause
                # (our own gate, or the servers'), and a request sent now would wait in the
                # paused server and crowd in ahead of what runs right after the update.
                if not server.healthy or not self.pool.running.is_set() or not self._gate.is_set():
                    return None
                sent = True
                server.inflight += 1
                try:
                    if key is not None and self._batcher is not None:
                        status, answer = await self._batcher.send(
                            server.addr, key, payload, lambda body, cap: self._post(server, body, cap))
                    else:
                        status, answer = await self._post(server, encode_request(payload), self.pool.max_response_bytes)
                finally:
                    server.inflight -= 1
        except asyncio.CancelledError:
            # Our own eviction (take_out) rather than the caller cancelling?
            if att.evicted is not None and att.task is not None and att.task.uncancel() == 0:
                if not sent:
                    return None
                raise AttemptFailure("evicted", f"server left the rotation ({att.evicted})") from None
            raise
        except SharedFailure as e:
            if e.error is None:
                raise _status_failure(self.wire, server, e.status, e.raw, shared=True) from None
            raise _exchange_failure(e.error, self.config.request_timeout_s, shared=True) from None
        except Exception as e:
            raise _exchange_failure(e, self.config.request_timeout_s) from None
        finally:
            server.attempts.discard(att)
        if status != 200:
            raise _status_failure(self.wire, server, status, answer)
        if not self.pool.pause_sent.is_set():  # answered (aborted) while a pause is fanned out
            await self.pool.pause_sent.wait()
        seg = self.wire.parse_generate(answer) if type(answer) is bytes else self.wire.parse_answer(answer)
        if seg.version is None:
            # No version reported (SGLang says "default" before its first update): fall back to
            # the client's version, counted, so that a server that never reports one shows up.
            self._counters["version_fallbacks"] += 1
            seg = seg._replace(version=self._version)
        return seg

    async def _post(self, server: ServerState, body: bytes, max_body: int) -> tuple[int, bytes]:
        """One ``generate_route`` exchange with ``server``: (status, answer body)."""
        route = self.wire.generate_route
        if server.conns is not None:
            return await server.conns.post(route, body, self.config.request_timeout_s, max_body=max_body)
        session = self.pool.session or self.pool.ensure_session()
        async with session.post(server.base_url + route, data=body, headers=JSON_HEADERS,
                                timeout=self._req_timeout) as resp:
            return resp.status, await read_body(resp, max_body)

    async def _wait_for_continue(self, rid: str, server: ServerState | None) -> None:
        """Hold a (re)submission until the servers continue, at most ``max_pause_s``
        after they were paused."""
        pool = self.pool
        left = pool.paused_at + self._max_pause_s - time.monotonic()
        try:
            await asyncio.wait_for(pool.running.wait(), max(left, 0.0))
        except TimeoutError:
            self._counters["failed"] += 1
            where = server.addr if server is not None else ", ".join(self.healthy_servers)
            raise GenerationError(
                f"request {rid}: inference server(s) {where} paused by pause_generation "
                f"{time.monotonic() - pool.paused_at:.0f}s ago and not continued within "
                f"max_pause_s={self._max_pause_s:g}s; did the weight update fail before "
                "continue_generation?"
            ) from None

    def _record_failure(self, s: ServerState, e: AttemptFailure) -> None:
        self._counters[_FAILURE_COUNTER[e.kind]] += 1
        s.n_failed += 1
        if e.kind == "evicted" or e.shared:
            return  # the server is already out, or the batch's sender counted the exchange
        s.consecutive_failures += 1
        logger.warning("%s%s failed (%s): %s", s.addr, self.wire.generate_route, e.kind, e)
        if s.healthy and s.consecutive_failures >= self.pool.unhealthy_after:
            self.pool.take_out(s, f"{s.consecutive_failures} consecutive failures, last: {e}")


def _exchange_failure(e: Exception, timeout_s: float, shared: bool = False) -> Exception:
    """What a failed exchange means for the attempt: a retryable `AttemptFailure`, or ``e``.
    ``shared``: the exchange was a batch this request joined (its sender counted it)."""
    if isinstance(e, AttemptFailure):  # a batch's answer that is not one (its sender raises the same)
        return AttemptFailure(e.kind, str(e), shared) if shared else e
    if isinstance(e, TimeoutError):
        return AttemptFailure("timeout", f"no answer within request_timeout_s={timeout_s:g}s", shared)
    if isinstance(e, HttpResponseTooLarge):
        return AttemptFailure("malformed", describe(e), shared)
    if isinstance(e, (aiohttp.ClientError, HttpConnectionError, HttpProtocolError)):
        return AttemptFailure("connection", describe(e), shared)
    return e


def _status_failure(wire: WireFormat, server: ServerState, status: int, raw: bytes, shared: bool = False) -> Exception:
    """A non-200 answer: retryable when the server's state explains it, else `BadRequestError`."""
    if retryable_status(status):
        return AttemptFailure("http_5xx", f"HTTP {status}: {snippet(raw)}", shared)
    return BadRequestError(server.addr, wire.generate_route, status, error_message(raw))


def _token_ids(ids: object, rid: str) -> list[int]:
    """``ids`` as a list of Python ints: integers of any kind (numpy's and torch's integer
    scalars too, or an integer array or tensor) are taken as they are; anything else (a float,
    a bool, a string) is refused, naming the request and the position."""
    if hasattr(ids, "tolist") and hasattr(ids, "dtype"):  # a numpy array or a torch tensor
        ids = ids.tolist()
    try:
        items = list(ids)  # type: ignore[call-overload]
    except TypeError:
        raise ValueError(f"GenerationRequest.input_ids of request {rid} must be a list of token ids (ints), "
                         f"got {ids!r:.80}") from None
    if not items:
        raise ValueError(f"GenerationRequest.input_ids of request {rid} is empty; give at least one token")
    prompt = []
    for i, t in enumerate(items):
        try:
            if isinstance(t, bool) or "bool" in str(getattr(t, "dtype", "")):
                raise TypeError("a bool is not a token id")
            prompt.append(operator.index(t))  # ints, numpy/torch integer scalars; never a float
        except TypeError:
            raise ValueError(
                f"GenerationRequest.input_ids must be a list of token ids (ints): input_ids[{i}] of request "
                f"{rid} is {t!r:.40} ({type(t).__name__}); give integer token ids (e.g. .long() or "
                ".astype(int)): a float is refused rather than truncated") from None
    return prompt


def _check_request(req: GenerationRequest) -> tuple[list[int], int]:
    """Validate at the boundary: a bad request fails here, not on the server."""
    if not isinstance(req, GenerationRequest):
        raise TypeError(f"agenerate expects a GenerationRequest, got {type(req).__name__}")
    ids = req.input_ids
    # Fast path (the usual case): a list of Python ints, every one of them checked (a float
    # anywhere would be serialized as such, or truncated by a conversion, and answered).
    if type(ids) is list and ids and set(map(type, ids)) == {int}:
        prompt = list(ids)
    else:
        prompt = _token_ids(ids, req.rid)
    if type(req.top_logprobs) is not int or not 0 <= req.top_logprobs <= 64:
        raise ValueError(f"GenerationRequest.top_logprobs={req.top_logprobs!r} of request {req.rid} must be "
                         "an int in [0, 64]")
    budget = req.sampling.max_new_tokens
    if type(budget) is not int or budget < 1:
        raise ValueError(
            f"SamplingParams.max_new_tokens={budget!r} of request {req.rid} must be an int >= 1"
        )
    return prompt, budget
