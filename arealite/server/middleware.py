"""The embedded server's gate: what every request passes before (and after) its handler.

In order: a foreign ``Origin`` is refused (403), then a missing or wrong API key
(401), then, for a POST with a body: any ``Content-Encoding`` (415; an inflated
body could be any size), a ``Content-Type`` other than ``application/json``
(415; a browser form cannot send that type without a CORS preflight, which this
server never grants), a ``Content-Length`` above the body cap (413, refused
before a byte of the body is read, and the connection closed so that the rest
is not read either).

Whatever a handler raises becomes a JSON error in SGLang's shape
(``{"error": {"message", "code"}}``) with a one-line reason, never a stack trace
or aiohttp's plain-text page. A handler other than ``/generate`` runs to its end
even when its client disconnects (a half-applied weight update would be worse
than a finished one nobody hears of); ``/generate`` is cancelled, and its
sequences leave the batch (`ModelRunner.generate`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Awaitable, Callable

from aiohttp import web

from .body import RequestError, error_response
from .limits import Limits, short

logger = logging.getLogger("arealite.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: Routes whose work is cancelled with their connection; every other route finishes.
CANCELLABLE = frozenset({"/generate"})


def make_guard(limits: Limits, api_key: str | None):
    """The aiohttp middleware enforcing `limits` and the key (None: no key needed)."""
    expected = f"Bearer {api_key}".encode() if api_key else None

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        refusal = refuse(request, limits, expected)
        if refusal is not None:
            return refusal
        try:
            if request.path in CANCELLABLE:
                return await handler(request)
            return await _finish_even_if_cancelled(handler(request))
        except RequestError as e:
            return error_response(str(e), status=400)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _http_error(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug or a library error: a clean 500, one log line
            logger.error("%s %s failed: %s: %s", request.method, request.path, type(e).__name__, short(str(e), 300),
                         exc_info=e)
            return error_response(f"internal error ({type(e).__name__}): {short(str(e), 200)}", status=500)

    return guard


def refuse(request: web.Request, limits: Limits, expected: bytes | None) -> web.Response | None:
    """The refusal of a request that may not reach its handler, or None."""
    origin = request.headers.get("Origin")
    if origin is not None and not limits.origin_allowed(origin):
        return error_response(
            f"origin {short(origin)} is not allowed: this server does not serve browsers "
            "(list the origin in server.allowed_origins / --allowed-origins to allow it)", status=403)
    # As SGLang: the health probes (every path starting with /health) need no key.
    if expected is not None and not request.path.startswith("/health"):
        # Compared as raw bytes: a non-ASCII header must be refused, not crash the comparison.
        got = _raw_header(request, b"authorization")
        if got is None or not hmac.compare_digest(got, expected):
            return error_response("unauthorized: send 'Authorization: Bearer <api key>'", status=401)
    if request.method != "POST" or not _has_body(request):
        ctype = request.headers.get("Content-Type")
        if request.method == "POST" and ctype is not None and not _is_json(ctype):
            return _unsupported_type(ctype)
        return None
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        return error_response(f"Content-Encoding {short(encoding)} is not accepted: send the JSON body "
                              "uncompressed", status=415)
    ctype = request.headers.get("Content-Type")
    if ctype is None or not _is_json(ctype):
        return _unsupported_type(ctype)
    length = request.content_length
    if length is not None and length > limits.max_body_bytes:
        resp = error_response(f"the request body ({length} bytes) exceeds the server's cap of "
                              f"{limits.max_body_bytes} bytes (server.max_body_bytes / --max-body-bytes)",
                              status=413)
        resp.force_close()  # do not read (and discard) the body that follows
        return resp
    return None


def _raw_header(request: web.Request, name: bytes) -> bytes | None:
    for key, value in request.raw_headers:
        if key.lower() == name:
            return value
    return None


def _has_body(request: web.Request) -> bool:
    return bool(request.content_length) or (request.content_length is None and request.can_read_body)


def _is_json(ctype: str) -> bool:
    return ctype.split(";", 1)[0].strip().lower() == "application/json"


def _unsupported_type(ctype: str | None) -> web.Response:
    got = "no Content-Type" if ctype is None else f"Content-Type {short(ctype)}"
    return error_response(f"{got}: send 'Content-Type: application/json' with a JSON body", status=415)


def _http_error(e: web.HTTPException) -> web.Response:
    """aiohttp's own errors (404, 405, 413 while reading...) in SGLang's JSON shape."""
    text = e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason
    resp = error_response(short(text, 300).strip("'\""), status=e.status)
    for key in ("Allow",):
        if key in e.headers:
            resp.headers[key] = e.headers[key]
    if e.status == 413:
        resp.force_close()
    return resp


async def _finish_even_if_cancelled(work: Awaitable[web.StreamResponse]) -> web.StreamResponse:
    """Await `work` in a task of its own that runs on when this request is cancelled."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(_consume)
    return await asyncio.shield(task)


def _consume(task: asyncio.Task) -> None:
    # A shielded task whose client left: its result or error has no reader.
    if not task.cancelled() and task.exception() is not None and not isinstance(
            task.exception(), (RequestError, web.HTTPException)):
        logger.debug("a request finished after its client left: %s", short(str(task.exception())))
