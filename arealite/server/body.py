"""Reading and checking the JSON bodies of the embedded server's requests, and error responses.

A bad request raises `RequestError`; the app's middleware turns it into a 400
whose message names the route and the field.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import orjson
from aiohttp import web

from arealite.utils.json_types import JsonObject, JsonValue

from .limits import LIMITS_KEY, OFFLOAD_BYTES, Limits, short
from .generate_request import RequestError

__all__ = ["RequestError", "check_fields", "error_response", "json_answer", "json_body", "off_loop", "want"]

T = TypeVar("T")

# Parsing and validating large bodies runs here, off the event loop. Two threads:
# enough to overlap with the loop, few enough that big requests queue, not pile up.
_PARSE_POOL: ThreadPoolExecutor | None = None


def error_response(message: str, status: int = 400) -> web.Response:
    """An error in SGLang's shape: ``{"error": {"message", "code"}}``."""
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def check_fields(body: JsonObject, required: set[str], optional: set[str], route: str) -> None:
    """Every ``required`` field is present and no field is outside ``required | optional``."""
    missing = sorted(required - set(body))
    if missing:
        raise RequestError(f"{route}: missing field(s) {missing}")
    unknown = sorted(set(body) - required - optional)
    if unknown:
        raise RequestError(f"{route}: unknown field(s) {short(unknown)}; known: {sorted(required | optional)}")


def want(body: JsonObject, key: str, types: type[T] | tuple[type[T], ...], route: str,
         default: T | None = None) -> T | None:
    """``body[key]`` checked against ``types`` (a bool is not an int here); ``default`` when absent or null."""
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,))):
        raise RequestError(f"{route}: field {key!r} has the wrong type ({type(v).__name__}: {short(v)})")
    return v


async def json_body(request: web.Request, allow_empty: bool = False) -> JsonObject:
    """The request's body, a JSON object (``{}`` for an empty body when ``allow_empty``).

    The body is read within the body timeout and the body cap (aiohttp's
    ``client_max_size`` counts chunked bodies as they arrive); a large one is parsed
    on a worker thread.
    """
    limits = request.app.get(LIMITS_KEY) or Limits()
    try:
        raw = await asyncio.wait_for(request.read(), limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise web.HTTPRequestTimeout(text=f"the request body did not arrive within {limits.body_timeout_s:g}s "
                                          "(server.body_timeout_s / --body-timeout-s)") from None
    if not raw.strip():
        if allow_empty:
            return {}
        raise RequestError("the request body is empty; send a JSON object")
    body = await off_loop(_decode, raw) if len(raw) > OFFLOAD_BYTES else _decode(raw)
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _decode(raw: bytes) -> JsonValue:
    try:
        return json.loads(raw)
    except RecursionError:
        raise RequestError("the request body is nested too deeply to parse; flatten it") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, over-long integers
        raise RequestError(f"the request body is not valid JSON: {short(str(e), 200)}") from None


def json_answer(obj: JsonValue) -> web.Response:
    """A 200 with ``obj`` as JSON, encoded by orjson: a /generate answer holds a float and an int
    per token, which the standard library encodes about 9 times slower (an abort of every
    running request answers them all at once). What orjson cannot encode (a string holding a
    lone surrogate) the standard library escapes."""
    try:
        body = orjson.dumps(obj)
    except TypeError:  # orjson.JSONEncodeError: e.g. a lone surrogate in a client's rid, which json escapes
        body = json.dumps(obj).encode()
    return web.Response(body=body, content_type="application/json")


async def off_loop(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` on the parse threads, so that the event loop keeps serving meanwhile."""
    global _PARSE_POOL
    if _PARSE_POOL is None:
        _PARSE_POOL = ThreadPoolExecutor(2, thread_name_prefix="arealite-parse")
    return await asyncio.get_running_loop().run_in_executor(_PARSE_POOL, lambda: fn(*args))
