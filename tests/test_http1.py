"""The lean HTTP/1.1 client of the generation hot path, against real TCP servers on 127.0.0.1.

Each test starts an asyncio server whose handler writes raw bytes, so every
framing (Content-Length, chunked, EOF-delimited), keep-alive rule and failure
(stale connection, close mid-answer, garbage, silence) is the real thing on
the wire.
"""

from __future__ import annotations

import asyncio

import pytest

from arealite.inference_client.http1 import Http1Pool, HttpConnectionError, HttpProtocolError


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        headers[k.strip().lower()] = v.strip()
    body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
    return lines[0], headers, body


def _ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)


class Server:
    """A scripted TCP server: ``answer(n_request, request_line, headers, body, writer)`` per request."""

    def __init__(self, answer):
        self.answer = answer
        self.connections = 0
        self.requests: list[tuple[bytes, dict, bytes]] = []
        self.server: asyncio.base_events.Server | None = None
        self.port = 0

    async def __aenter__(self) -> "Server":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    line, headers, body = await _read_request(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                self.requests.append((line, headers, body))
                keep = await self.answer(len(self.requests), line, headers, body, writer)
                await writer.drain()
                if keep is False:
                    return
        finally:
            writer.close()


async def _echo(n, line, headers, body, writer):
    writer.write(_ok(b'{"n": %d, "echo": %s}' % (n, body)))


async def test_keep_alive_reuses_one_connection_and_sends_the_request_as_given():
    async with Server(_echo) as srv:
        pool = Http1Pool("127.0.0.1", srv.port, {"Authorization": "Bearer sk-test"})
        for i in range(3):
            status, body = await pool.post("/generate", b'{"i": %d}' % i, timeout=5)
            assert status == 200 and body == b'{"n": %d, "echo": {"i": %d}}' % (i + 1, i)
        assert srv.connections == 1
        line, headers, body = srv.requests[0]
        assert line == b"POST /generate HTTP/1.1"
        assert headers[b"content-type"] == b"application/json"
        assert headers[b"authorization"] == b"Bearer sk-test"
        assert headers[b"host"] == f"127.0.0.1:{srv.port}".encode()
        await pool.aclose()


async def test_concurrent_requests_use_separate_connections_and_all_complete():
    async def slow_echo(n, line, headers, body, writer):
        await asyncio.sleep(0.05)
        writer.write(_ok(body))

    async with Server(slow_echo) as srv:
        pool = Http1Pool("127.0.0.1", srv.port)
        outs = await asyncio.gather(*(pool.post("/g", b"%d" % i, timeout=5) for i in range(8)))
        assert [b for _, b in outs] == [b"%d" % i for i in range(8)]
        assert srv.connections == 8
        outs = await asyncio.gather(*(pool.post("/g", b"x", timeout=5) for _ in range(8)))
        assert srv.connections == 8  # the second wave reuses the pooled connections
        await pool.aclose()


async def test_chunked_answer_split_across_writes_with_a_trailer():
    async def chunked(n, line, headers, body, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel")
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.write(b"lo\r\n7;ext=1\r\n, world\r\n0\r\nX-Trailer: 1\r\n")
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.write(b"\r\n")

    async with Server(chunked) as srv:
        pool = Http1Pool("127.0.0.1", srv.port)
        assert await pool.post("/g", b"{}", timeout=5) == (200, b"hello, world")
        assert await pool.post("/g", b"{}", timeout=5) == (200, b"hello, world")
        assert srv.connections == 1
        await pool.aclose()


async def test_connection_close_and_eof_delimited_bodies_are_not_reused():
    async def closing(n, line, headers, body, writer):
        if n == 1:
            writer.write(_ok(b"one", b"Connection: close\r\n"))
        else:  # HTTP/1.0 style: no length, the body ends with the connection
            writer.write(b"HTTP/1.0 200 OK\r\n\r\nbody until eof")
        return False

    async with Server(closing) as srv:
        pool = Http1Pool("127.0.0.1", srv.port)
        assert await pool.post("/g", b"{}", timeout=5) == (200, b"one")
        assert await pool.post("/g", b"{}", timeout=5) == (200, b"body until eof")
        assert srv.connections == 2
        await pool.aclose()


async def test_a_pooled_connection_the_server_closed_is_resent_once_on_a_fresh_one():
    async def answer_then_hang_up(n, line, headers, body, writer):
        writer.write(_ok(b"%d" % n))  # says nothing about closing, then closes (keep-alive timeout)
        return False

    async with Server(answer_then_hang_up) as srv:
        pool = Http1Pool("127.0.0.1", srv.port)
        assert await pool.post("/g", b"{}", timeout=5) == (200, b"1")
        await asyncio.sleep(0.05)  # the close reaches us: the pool drops the connection
        assert await pool.post("/g", b"{}", timeout=5) == (200, b"2")
        assert srv.connections == 2 and len(srv.requests) == 2  # nothing was sent twice
        await pool.aclose()


async def test_a_reused_connection_dropped_just_as_it_is_used_is_resent_on_a_fresh_one():
    # The race the resend exists for: the server drops the idle connection when the
    # next request arrives on it (keep-alive timeout firing at that moment).
    async def drop_second_on_first_connection(n, line, headers, body, writer):
        if n == 2:
            return False  # read the request, close without a byte of answer
        writer.write(_ok(b"%d" % n))

    async with Server(drop_second_on_first_connection) as srv:
        pool = Http1Pool("127.0.0.1", srv.port)
        assert await pool.post("/g", b"{}", timeout=5) == (200, b"1")
        assert await pool.post("/g", b"{}", timeout=5) == (200, b"3")
        assert srv.connections == 2
        await pool.aclose()


def test_a_pooled_connection_whose_transport_closed_unnoticed_is_resent_on_a_fresh_one():
    # A server killed under a pooled connection: its transport is closing before the event
    # loop has told the connection. The request must go out once, on a fresh connection.
    # (Under uvloop, the rollout loop's, a write on a handle already closed raises RuntimeError;
    # the pool now treats that as a closed connection too. That race is not reproduced here.)
    uvloop = pytest.importorskip("uvloop")

    async def main():
        async with Server(_echo) as srv:
            pool = Http1Pool("127.0.0.1", srv.port)
            assert (await pool.post("/g", b"{}", timeout=5))[0] == 200
            idle = pool._idle[-1]  # private-ok: the test closes the pooled socket behind the pool's back
            idle.transport.close()  # no await in between: connection_lost has not run yet
            assert (await pool.post("/g", b"{}", timeout=5))[0] == 200
            assert srv.connections == 2 and len(srv.requests) == 2  # sent once, on a fresh connection
            await pool.aclose()

    uvloop.run(main())


async def test_idle_connections_older_than_max_idle_are_not_reused():
    async with Server(_echo) as srv:
        pool = Http1Pool("127.0.0.1", srv.port, max_idle_s=0.05)
        await pool.post("/g", b"1", timeout=5)
        await asyncio.sleep(0.1)
        await pool.post("/g", b"2", timeout=5)
        assert srv.connections == 2
        await pool.aclose()


async def test_close_mid_answer_is_a_connection_error_and_is_not_resent():
    async def half(n, line, headers, body, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        return False

    async with Server(half) as srv:
        pool = Http1Pool("127.0.0.1", srv.port)
        with pytest.raises(HttpConnectionError, match="mid-response"):
            await pool.post("/g", b"{}", timeout=5)
        assert len(srv.requests) == 1
        await pool.aclose()


async def test_a_fresh_connection_closed_without_an_answer_is_an_error():
    async def hang_up(n, line, headers, body, writer):
        return False

    async with Server(hang_up) as srv:
        pool = Http1Pool("127.0.0.1", srv.port)
        with pytest.raises(HttpConnectionError, match="without answering"):
            await pool.post("/g", b"{}", timeout=5)
        assert len(srv.requests) == 1  # a fresh connection is never resent
        await pool.aclose()


@pytest.mark.parametrize("answer, match", [
    (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n", "bad Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nabc", "more bytes than its Content-Length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
])
async def test_garbage_answers_are_protocol_errors(answer, match):
    async def garbage(n, line, headers, body, writer):
        writer.write(answer)

    async with Server(garbage) as srv:
        pool = Http1Pool("127.0.0.1", srv.port)
        with pytest.raises(HttpProtocolError, match=match):
            await pool.post("/g", b"{}", timeout=5)
        assert pool.stats()["idle"] == 0  # a connection out of step is never pooled
        await pool.aclose()


async def test_interim_100_continue_is_skipped():
    async def cont(n, line, headers, body, writer):
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + _ok(b"done"))

    async with Server(cont) as srv:
        pool = Http1Pool("127.0.0.1", srv.port)
        assert await pool.post("/g", b"{}", timeout=5) == (200, b"done")
        await pool.aclose()


async def test_silence_times_out_and_the_connection_is_dropped():
    release = asyncio.Event()

    async def silent(n, line, headers, body, writer):
        if n == 1:
            await release.wait()
            writer.write(_ok(b"late"))
            return False
        writer.write(_ok(b"fine"))

    async with Server(silent) as srv:
        pool = Http1Pool("127.0.0.1", srv.port)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(TimeoutError):
            await pool.post("/g", b"{}", timeout=0.2)
        assert 0.15 < loop.time() - t0 < 2.0
        release.set()
        # The late answer must not be taken for the next request's.
        assert await pool.post("/g", b"{}", timeout=5) == (200, b"fine")
        assert srv.connections == 2
        await pool.aclose()


async def test_cancelling_a_request_closes_its_connection():
    started = asyncio.Event()

    async def never(n, line, headers, body, writer):
        if n == 1:
            started.set()
            await asyncio.sleep(30)
        writer.write(_ok(b"ok"))

    async with Server(never) as srv:
        pool = Http1Pool("127.0.0.1", srv.port)
        task = asyncio.ensure_future(pool.post("/g", b"{}", timeout=60))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pool.stats() == {"idle": 0, "live": 0}
        assert await pool.post("/g", b"{}", timeout=5) == (200, b"ok")
        await pool.aclose()


async def test_refused_connection_names_the_address():
    srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    srv.close()
    await srv.wait_closed()
    pool = Http1Pool("127.0.0.1", port)
    with pytest.raises(HttpConnectionError, match=f"cannot connect to 127.0.0.1:{port}"):
        await pool.post("/g", b"{}", timeout=5)
    await pool.aclose()
    with pytest.raises(HttpConnectionError, match="closed"):
        await pool.post("/g", b"{}", timeout=5)
