"""A lean HTTP/1.1 client for the generation hot path: keep-alive POSTs of JSON bodies.

Why not aiohttp here: a ``/generate`` call with one new token is dominated by
the client's own Python, and aiohttp's request machinery (sessions, tracing,
cookie jars, response objects, stream readers) costs ~3x what this needs. The
rollout controller runs every request of the run on one thread, so that
cost caps the trajectories per second of the whole system. This module does
only what ``/generate`` needs and nothing else:

- one asyncio ``Protocol`` per TCP connection, pooled per server (keep-alive,
  last used first); the caller bounds how many are in flight;
- the request is written in one ``transport.write`` (head + body);
- the response is parsed in place: status line, headers, then a
  ``Content-Length`` body, a ``chunked`` body, or a body that ends at EOF;
- a per-request deadline (one timer, no extra task);
- a request that finds its pooled connection closed by the server before a
  single byte of answer came back is sent again once on a fresh connection
  (the server's keep-alive timeout can close a connection just as it is
  reused); idle connections older than ``max_idle_s`` are not reused at all.

Errors: ``TimeoutError`` (deadline), ``HttpConnectionError`` (could not
connect, or the connection dropped mid-request), ``HttpProtocolError`` (the
answer is not HTTP/1.x), ``HttpResponseTooLarge`` (its body would exceed the
pool's ``max_body``: refused from ``Content-Length`` or as it arrives). Parsing
is linear in the bytes received, however the server splits them. Admin calls,
health probes and TLS stay on aiohttp.
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["Http1Pool", "HttpConnectionError", "HttpProtocolError", "HttpResponseTooLarge"]

_MAX_HEAD = 64 * 1024  # bytes of status line + headers we accept


class HttpConnectionError(ConnectionError):
    """Could not connect, or the server closed the connection before the answer was complete."""


class HttpProtocolError(ConnectionError):
    """The server's answer is not well-formed HTTP/1.x."""


class HttpResponseTooLarge(HttpProtocolError):
    """The answer's body is larger than the client accepts (``max_body``)."""


class _Stale(Exception):
    """A reused connection was closed before any byte of the answer arrived (safe to resend once)."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection; parses one response at a time."""

    __slots__ = ("transport", "closed", "fut", "buf", "got_bytes", "head_end", "status", "length",
                 "chunked", "keep_alive", "idle_since", "pool", "scan", "cpos", "cbody", "clast", "max_body")

    def __init__(self, pool: "Http1Pool"):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.fut: asyncio.Future | None = None
        self.buf = bytearray()
        self.idle_since = 0.0
        self.max_body = pool.max_body  # of the answer being read (a request may allow more)
        self._reset()

    def _reset(self) -> None:
        self.got_bytes = False
        self.head_end = -1
        self.status = 0
        self.length = -1  # -1: until EOF (unless chunked)
        self.chunked = False
        self.keep_alive = True
        self.scan = 0  # where the next search for a line end starts (nothing before it matches)
        self.cpos = -1  # chunked: start of the next chunk-size line (-1: not started)
        self.cbody = bytearray()  # chunked: the body decoded so far
        self.clast = False  # chunked: the zero-size chunk is in; waiting for the trailer's end

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.fut is None or self.fut.done():
            # Bytes nobody asked for: the connection is out of step with its requests.
            self.close()
            return
        self.got_bytes = True
        self.buf += data
        try:
            self._parse()
        except HttpProtocolError as e:
            self._fail(e)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        fut = self.fut
        if fut is None or fut.done():
            return
        if self.head_end >= 0 and self.length < 0 and not self.chunked:
            self._finish(bytes(self.buf[self.head_end:]))  # a body delimited by EOF
            return
        if not self.got_bytes:
            fut.set_exception(_Stale())
            return
        why = f": {exc}" if exc else ""
        fut.set_exception(HttpConnectionError(f"server closed the connection mid-response{why}"))

    # -- parsing
    def _parse(self) -> None:
        buf = self.buf
        if self.head_end < 0:
            end = buf.find(b"\r\n\r\n", self.scan)
            if end < 0:
                if len(buf) > _MAX_HEAD:
                    raise HttpProtocolError(f"response head is larger than {_MAX_HEAD} bytes")
                self.scan = max(0, len(buf) - 3)
                return
            self._parse_head(bytes(buf[:end]))
            self.head_end = end + 4
            if 100 <= self.status < 200:  # an interim answer (100 Continue): the real one follows
                del buf[: self.head_end]
                self._reset()
                self.got_bytes = True
                if buf:
                    self._parse()
                return
        if len(buf) - self.head_end > self.max_body:
            raise HttpResponseTooLarge(f"response body exceeds max_body={self.max_body} bytes")
        if self.chunked:
            self._parse_chunked()
        elif self.length >= 0 and len(buf) - self.head_end >= self.length:
            if len(buf) - self.head_end > self.length:
                raise HttpProtocolError("the server sent more bytes than its Content-Length")
            self._finish(bytes(buf[self.head_end:]))

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise HttpProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        self.status = int(parts[1])
        self.keep_alive = parts[0] != b"HTTP/1.0"
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise HttpProtocolError(f"malformed header line: {line[:80]!r}")
            name = name.strip().lower()
            if name == b"content-length":
                value = value.strip()
                if not value.isdigit():
                    raise HttpProtocolError(f"bad Content-Length: {value[:40]!r}")
                self.length = int(value)
                if self.length > self.max_body:
                    raise HttpResponseTooLarge(f"Content-Length {self.length} exceeds max_body="
                                               f"{self.max_body} bytes")
            elif name == b"transfer-encoding":
                self.chunked = b"chunked" in value.lower()
            elif name == b"connection":
                v = value.strip().lower()
                if v == b"close":
                    self.keep_alive = False
                elif v == b"keep-alive":
                    self.keep_alive = True
        if self.chunked:
            self.length = -1
        elif self.status in (204, 304):
            self.length = 0

    def _parse_chunked(self) -> None:
        # Resumes where the previous call stopped (cpos, scan): each byte is looked at a
        # bounded number of times, so a body sent as many tiny chunks costs linear time.
        buf = self.buf
        if self.cpos < 0:
            self.cpos = self.scan = self.head_end
        while not self.clast:
            eol = buf.find(b"\r\n", max(self.cpos, self.scan))
            if eol < 0:
                self.scan = max(self.cpos, len(buf) - 1)
                return
            size_text = bytes(buf[self.cpos:eol]).split(b";", 1)[0].strip()
            if not size_text or len(size_text) > 16 or size_text.strip(b"0123456789abcdefABCDEF"):
                raise HttpProtocolError(f"bad chunk size {size_text[:20]!r}")
            size = int(size_text, 16)
            if size == 0:  # last chunk; optional trailer lines, then an empty line
                self.clast, self.scan = True, eol
                break
            start, stop = eol + 2, eol + 2 + size
            if len(buf) < stop + 2:
                self.scan = eol  # the size line is parsed again (cheap) once the chunk is in
                return
            if buf[stop:stop + 2] != b"\r\n":
                raise HttpProtocolError("a chunk does not end with CRLF where its size says")
            self.cbody += buf[start:stop]
            self.cpos = self.scan = stop + 2
        end = buf.find(b"\r\n\r\n", self.scan)
        if end < 0:
            self.scan = max(self.scan, len(buf) - 3)
            return
        self._finish(bytes(self.cbody))

    def _finish(self, body: bytes) -> None:
        fut, self.fut = self.fut, None
        status, keep = self.status, self.keep_alive
        self.buf = bytearray()
        self._reset()
        if fut is not None and not fut.done():
            fut.set_result((status, body, keep))

    def _fail(self, exc: BaseException) -> None:
        fut, self.fut = self.fut, None
        self.close()
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
            self.pool.forget(self)


class Http1Pool:
    """Keep-alive HTTP/1.1 connections to one ``host:port``.

    ``headers``: extra request headers sent with every request (an
    ``Authorization`` header, say); they are never logged. ``max_body``: the
    largest response body accepted (bytes on the wire, chunk framing included).
    """

    def __init__(self, host: str, port: int, headers: dict[str, str] | None = None, max_idle_s: float = 2.0,
                 max_body: int = 64 << 20):
        self.host, self.port = host, int(port)
        self.max_idle_s = max_idle_s
        self.max_body = int(max_body)
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head_tail = f"Host: {host}:{port}\r\nUser-Agent: arealite\r\n{extra}".encode("latin-1")
        self._idle: list[_Conn] = []
        self._live: set[_Conn] = set()
        self._closed = False

    def forget(self, conn: _Conn) -> None:
        """Stop tracking ``conn`` (it closed or was lost); a connection calls this itself."""
        self._live.discard(conn)

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> _Conn:
        try:
            _, conn = await loop.create_connection(lambda: _Conn(self), self.host, self.port)
        except OSError as e:
            raise HttpConnectionError(f"cannot connect to {self.host}:{self.port}: {e}") from None
        if self._closed:
            conn.close()
            raise HttpConnectionError("the connection pool is closed")
        self._live.add(conn)
        return conn

    def _take_idle(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < self.max_idle_s:
                return conn
            conn.close()
        return None

    async def warm(self, timeout: float | None = None) -> None:
        """Have an idle connection ready for the next request: one opened now unless a fresh
        one is idle already (raises as `post` does when it cannot connect)."""
        conn = self._take_idle()
        if conn is None:
            loop = asyncio.get_running_loop()
            conn = await self._connect_by(loop, None if timeout is None else loop.time() + timeout)
            conn.idle_since = time.monotonic()
        self._idle.append(conn)

    async def post(self, path: str, body: bytes, timeout: float | None = None,
                   content_type: str = "application/json", max_body: int | None = None) -> tuple[int, bytes]:
        """POST ``body`` to ``path``; return (status, response body).

        ``max_body``: the largest answer accepted for this request (default: the pool's).

        Raises ``TimeoutError`` when no complete answer came within ``timeout``
        seconds (connecting included), ``HttpConnectionError`` or
        ``HttpProtocolError`` otherwise.
        """
        if self._closed:
            raise HttpConnectionError("the connection pool is closed")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        request = b"".join((
            b"POST ", path.encode("latin-1"), b" HTTP/1.1\r\n", self._head_tail,
            b"Content-Type: ", content_type.encode("latin-1"),
            b"\r\nContent-Length: ", str(len(body)).encode(), b"\r\n\r\n", body,
        ))
        for attempt in range(2):
            conn = self._take_idle() if attempt == 0 else None
            reused = conn is not None
            if conn is None:
                conn = await self._connect_by(loop, deadline)
            conn.max_body = self.max_body if max_body is None else int(max_body)
            try:
                status, data, keep = await self._exchange(loop, conn, request, deadline)
            except _Stale:
                conn.close()
                if reused:
                    continue  # the server had closed this idle connection: resend on a new one
                raise HttpConnectionError("server closed the connection without answering") from None
            except BaseException:
                conn.close()  # mid-request (cancelled, timed out, failed): never reuse it
                raise
            if keep and not conn.closed and not self._closed:
                conn.idle_since = time.monotonic()
                self._idle.append(conn)
            else:
                conn.close()
            return status, data
        raise AssertionError("unreachable")  # pragma: no cover

    async def _connect_by(self, loop: asyncio.AbstractEventLoop, deadline: float | None) -> _Conn:
        if deadline is None:
            return await self._connect(loop)
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise TimeoutError("deadline passed before connecting")
        try:
            return await asyncio.wait_for(self._connect(loop), remaining)
        except asyncio.TimeoutError:
            raise TimeoutError(f"connecting to {self.host}:{self.port} timed out") from None

    @staticmethod
    async def _exchange(loop: asyncio.AbstractEventLoop, conn: _Conn, request: bytes,
                        deadline: float | None) -> tuple[int, bytes, bool]:
        fut = loop.create_future()
        conn.fut = fut
        timer = None
        if deadline is not None:
            timer = loop.call_at(deadline, _expire, fut)
        try:
            transport = conn.transport
            if transport is None or transport.is_closing():
                raise _Stale()  # closed (the server went away) after it was taken: nothing was sent
            try:
                transport.write(request)
            except RuntimeError:  # uvloop: the handle closed under us, between the check and the write
                raise _Stale() from None
            return await fut
        finally:
            if timer is not None:
                timer.cancel()
            conn.fut = None

    async def aclose(self) -> None:
        """Close every connection (idle or in use)."""
        self._closed = True
        for conn in list(self._live) + self._idle:
            conn.close()
        self._idle.clear()
        self._live.clear()

    def stats(self) -> dict[str, int]:
        return {"idle": len(self._idle), "live": len(self._live)}


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError("no complete answer before the deadline"))
