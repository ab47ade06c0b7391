"""Errors of the inference client and of the servers' administration.

Shared by every backend (the client core, the SGLang wire format and admin, a later
vLLM one), so that callers catch the same types whatever the servers are.
"""

from __future__ import annotations

__all__ = [
    "AttemptFailure",
    "BadRequestError",
    "GenerationError",
    "NoHealthyServerError",
    "ServerAdminError",
    "ServerStartupError",
]


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

    def __init__(self, route: str, failures: dict[str, str], results: dict[str, object]):
        self.route, self.failures, self.results = route, failures, results
        detail = "; ".join(f"{addr}: {cause}" for addr, cause in failures.items())
        super().__init__(f"{route} failed on {len(failures)} server(s): {detail}")


class ServerStartupError(RuntimeError):
    """Servers did not become healthy within the start-up timeout."""


class AttemptFailure(Exception):
    """One HTTP attempt failed in a way another server may not (retryable).

    ``kind`` is one of timeout, connection, http_5xx, malformed, evicted. ``shared``: the
    failed exchange was another request's (a batch it joined), which counted it against the
    server already.
    """

    def __init__(self, kind: str, cause: str, shared: bool = False):
        self.kind = kind
        self.shared = shared
        super().__init__(cause)
