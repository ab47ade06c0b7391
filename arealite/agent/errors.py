"""Errors the OpenAI-compatible endpoint answers, in OpenAI's shape.

``{"error": {"message", "type", "param", "code"}}`` with the HTTP status OpenAI uses, so
that the ``openai`` client raises its usual exception (``BadRequestError``,
``AuthenticationError``, ...) with our message.
"""

from __future__ import annotations

from arealite.utils.json_types import JsonObject


class RequestError(Exception):
    """A request the endpoint refuses; ``param`` names the offending field."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int = 400, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def body(self) -> JsonObject:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def unsupported_parameter(name: str, why: str = "") -> RequestError:
    return RequestError(f"Unsupported parameter: '{name}' is not supported by this endpoint{why}.",
                        param=name, code="unsupported_parameter")


def unsupported_value(name: str, why: str) -> RequestError:
    return RequestError(f"Unsupported value: '{name}' {why}.", param=name, code="unsupported_value")


def invalid_session(how: str) -> RequestError:
    return RequestError(f"Incorrect API key provided: {how}. Each episode's client carries its own "
                        "session key (or a /s/<session>/v1 base URL); this one is unknown or its episode ended.",
                        code="invalid_api_key", status=401)
