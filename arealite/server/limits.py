"""What one request may cost the embedded server, and how user values are quoted.

The server runs for days next to a trainer; one hostile or careless request must
not freeze it, grow its memory without bound or forge its log. `Limits` holds the
caps (set by the command line, `ServerArgs`, and `ServerConfig` through the
launcher); `short` quotes a value in an error message by a bounded prefix and
`escape` makes a user value safe to log on one line.
"""

from __future__ import annotations

import logging
import reprlib
import traceback
from dataclasses import dataclass, field

from aiohttp import web

#: Bodies above this many bytes are parsed and validated on a worker thread, so
#: that the event loop keeps answering (`/health`) meanwhile; smaller ones inline.
OFFLOAD_BYTES = 64 * 1024

#: A text prompt may hold at most this many characters per token of context: no
#: tokenizer needs more, and tokenizing megabytes only to refuse them costs seconds.
CHARS_PER_TOKEN = 16


@dataclass(frozen=True)
class Limits:
    """The caps one request runs under (see ``docs/security.md``)."""

    max_body_bytes: int = 8 * 1024 * 1024
    """Largest request body, counted on the wire; ``Content-Length`` above it is refused unread."""
    max_prompts: int = 1024
    """Most prompts in one ``/generate`` batch."""
    max_request_tokens: int = 1 << 20
    """Most tokens one ``/generate`` request may ask for: prompts plus ``max_new_tokens``, summed."""
    idle_timeout_s: float = 60.0
    """A connection that has not sent a complete request head this long after connecting (or
    after its last answer) is closed: idle keep-alive connections and slow-header clients."""
    body_timeout_s: float = 60.0
    """Longest wait for a request body once its head has arrived."""
    allowed_origins: frozenset[str] = field(default_factory=frozenset)
    """Browser origins (``scheme://host[:port]``) whose requests are served; any other ``Origin``
    header is refused, so that a web page cannot drive the server (cross-site request forgery)."""

    def origin_allowed(self, origin: str) -> bool:
        return normalize_origin(origin) in self.allowed_origins


def normalize_origin(origin: str) -> str:
    """``HTTP://Host:8000/`` -> ``http://host:8000``: how origins are compared."""
    return origin.strip().rstrip("/").lower()


LIMITS_KEY = web.AppKey("arealite_limits", Limits)

_quote = reprlib.Repr()
_quote.maxstring = 60
_quote.maxother = 60
_quote.maxlong = 40
_quote.maxlist = _quote.maxtuple = _quote.maxset = _quote.maxdict = 6
_quote.maxlevel = 3


def short(value: object, limit: int = 100) -> str:
    """A bounded, one-line quotation of a user value for an error message.

    ``reprlib`` stops early in large containers and deep nesting, so quoting a
    megabyte-long list costs no more than quoting a short one.
    """
    if isinstance(value, str):  # a path or name: keep up to `limit` characters of it, not reprlib's 60
        text = escape(repr(value[:limit]))
        return text if len(value) <= limit else text + "..."
    text = escape(_quote.repr(value))
    return text if len(text) <= limit else text[:limit - 3] + "..."


def escape(text: str) -> str:
    """``text`` with newlines, control characters and lone surrogates written as escapes,
    so that a user value can never start a new (forged) log line."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape_char(ch) for ch in text)


def _escape_char(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


class EscapingFilter(logging.Filter):
    """Makes every record of a logger one line: the message with its user values escaped,
    and a traceback whose exception message (which may quote a user value) is escaped."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: keep the raw template
            message = str(record.msg)
        record.msg, record.args = escape(message), None
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            frames = "".join(traceback.format_tb(exc.__traceback__))
            record.exc_text = f"Traceback (most recent call last):\n{frames}{type(exc).__qualname__}: {escape(str(exc))}"
            record.exc_info = None
        return True


def install_log_filter(*names: str) -> None:
    """Escape user values in the records of these loggers (idempotent)."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, EscapingFilter) for f in logger.filters):
            logger.addFilter(EscapingFilter())
