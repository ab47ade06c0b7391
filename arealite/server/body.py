"""Reading and checking the JSON bodies of the embedded server's requests, and error responses.

A bad request raises `RequestError`; the app's middleware turns it into a 400
whose message names the route and the field.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from .sampling import RequestError

__all__ = ["RequestError", "check_fields", "error_response", "json_body", "want"]


def error_response(message: str, status: int = 400) -> web.Response:
    """An error in SGLang's shape: ``{"error": {"message", "code"}}``."""
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def check_fields(body: dict, required: set[str], optional: set[str], route: str) -> None:
    """Every ``required`` field is present and no field is outside ``required | optional``."""
    missing = sorted(required - set(body))
    if missing:
        raise RequestError(f"{route}: missing field(s) {missing}")
    unknown = sorted(set(body) - required - optional)
    if unknown:
        raise RequestError(f"{route}: unknown field(s) {unknown}; known: {sorted(required | optional)}")


def want(body: dict, key: str, types: type | tuple[type, ...], route: str, default: Any = None) -> Any:
    """``body[key]`` checked against ``types`` (a bool is not an int here); ``default`` when absent or null."""
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,))):
        raise RequestError(f"{route}: field {key!r} has the wrong type ({type(v).__name__}: {v!r})")
    return v


async def json_body(request: web.Request, allow_empty: bool = False) -> dict:
    """The request's body, a JSON object (``{}`` for an empty body when ``allow_empty``)."""
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return {}
        raise RequestError("the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body
