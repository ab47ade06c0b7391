"""The client trusts no server: a malicious fake server on 127.0.0.1 answers /generate with
crafted bytes, an honest one beside it answers correctly.

Every bad answer must be refused as a malformed answer (or a broken connection) and the
request must fail over to the honest server: nothing bad reaches the completion, nothing is
lost. The servers speak raw HTTP/1.1 over asyncio streams, so a test controls every byte
(status line, headers, chunk framing) and not only the JSON.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest

from arealite.api.types import GenerationRequest, SamplingParams
from arealite.config.schema import RolloutConfig
from arealite.inference_client.errors import AttemptFailure, GenerationError, ServerStartupError
from arealite.inference_client.response_check import check_segment
from arealite.inference_client.sglang_client import SGLangClient
from arealite.inference_client.wire import Segment

VOCAB = 100
HONEST_IDS = [11, 12, 13]


def honest_body(ids=HONEST_IDS, version="3") -> bytes:
    meta = {"finish_reason": {"type": "length"}, "weight_version": version,
            "output_token_logprobs": [[-0.5, t, None] for t in ids]}
    return json.dumps({"output_ids": ids, "meta_info": meta}).encode()


def http(body: bytes, status: str = "200 OK", extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 " + status.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body)


def chunked(body: bytes, size: int) -> bytes:
    parts = [b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size]) for i in range(0, len(body), size)]
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"".join(parts) + b"0\r\n\r\n"


class RawServer:
    """A minimal HTTP/1.1 server: GETs of the info routes answer as SGLang does; every
    POST /generate is answered with ``self.answer`` (raw bytes, or an async callable
    given the writer)."""

    def __init__(self, answer=None):
        self.answer = answer if answer is not None else http(honest_body())
        self.info = json.dumps({"version": "0.5.23", "tp_size": 1}).encode()
        self.generates = 0

    async def start(self) -> "RawServer":
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.addr = "127.0.0.1:%d" % self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self.server.close()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                length = next((int(v) for k, _, v in (h.partition(":") for h in lines[1:])
                               if k.lower() == "content-length"), 0)
                if length:
                    await reader.readexactly(length)
                if method == "GET":
                    body = self.info if path in ("/server_info", "/get_server_info") else b"{}"
                    writer.write(http(body) if path != "/openapi.json" else http(b"{}", "404 Not Found"))
                else:
                    self.generates += 1
                    if callable(self.answer):
                        await self.answer(writer)
                        return
                    writer.write(self.answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def cfg(**kw) -> RolloutConfig:
    base = dict(request_timeout_s=5.0, request_retries=2, retry_backoff_s=0.0, max_response_bytes=1 << 20)
    base.update(kw)
    return RolloutConfig(**base)


def req(max_new: int = 4) -> GenerationRequest:
    return GenerationRequest(input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=max_new))


async def generate_with_failover(answer, **config):
    """One request to [evil, honest] (the round-robin tries the evil server first)."""
    evil, honest = await RawServer(answer).start(), await RawServer().start()
    try:
        async with SGLangClient([evil.addr, honest.addr], cfg(**config), vocab_size=VOCAB) as eng:
            await eng.initialize(timeout=5)
            c = await eng.agenerate(req())
            stats = eng.stats()
        assert evil.generates == 1 and honest.generates == 1
        return c, stats
    finally:
        await evil.stop()
        await honest.stop()


def answer_with(ids=None, lps=None, version="3", finish="length", drop=()) -> bytes:
    ids = HONEST_IDS if ids is None else ids
    lps = [-0.5] * len(ids) if lps is None else lps
    meta = {"finish_reason": {"type": finish}, "weight_version": version,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}
    data = {"output_ids": ids, "meta_info": meta}
    for k in drop:
        data.pop(k, None)
        meta.pop(k, None)
    return http(json.dumps(data, allow_nan=True).encode())


# The JSON is well-formed HTTP; its content is not a possible answer.
BAD_CONTENT = {
    "id_at_vocab_size": answer_with(ids=[11, VOCAB, 13]),
    "id_far_out_of_vocab": answer_with(ids=[11, 2**40, 13]),
    "negative_id": answer_with(ids=[11, -1, 13]),
    "float_id": answer_with(ids=[11, 12.0, 13]),
    "bool_id": answer_with(ids=[True, 12, 13]),
    "string_id": answer_with(ids=["11", 12, 13]),
    "more_tokens_than_budget": answer_with(ids=[11, 12, 13, 14, 15]),
    "positive_logprob": answer_with(lps=[-0.5, 0.5, -0.5]),
    "nan_logprob_literal": answer_with(lps=[-0.5, math.nan, -0.5]),
    "infinite_logprob_literal": answer_with(lps=[-0.5, -math.inf, -0.5]),
    "string_logprob": http(b'{"output_ids":[11],"meta_info":{"finish_reason":{"type":"length"},'
                           b'"output_token_logprobs":[["-0.5",11,null]]}}'),
    "ids_disagree_with_logprobs": http(b'{"output_ids":[11,12],"meta_info":{"finish_reason":{"type":"length"},'
                                       b'"output_token_logprobs":[[-0.5,11,null]]}}'),
    "negative_weight_version": answer_with(version=-4),
    "huge_weight_version": answer_with(version=10**30),
    "unknown_finish_reason": answer_with(finish="exploded"),
    "no_meta_info": http(b'{"output_ids":[11,12,13]}'),
    "not_json": http(b"<html>proxy error</html>"),
    "json_list_of_two": http(b"[{}, {}]"),
    "deeply_nested_json": http(b"[" * 200_000 + b"]" * 200_000),
    "nan_in_other_field": http(b'{"output_ids":[11],"meta_info":{"finish_reason":{"type":"length"},'
                               b'"e2e_latency":NaN,"output_token_logprobs":[[-0.5,11,null]]}}'),
}


@pytest.mark.parametrize("case", sorted(BAD_CONTENT))
async def test_impossible_answers_are_malformed_and_fail_over(case):
    c, stats = await generate_with_failover(BAD_CONTENT[case])
    assert c.output_ids == HONEST_IDS and c.output_logprobs == [-0.5] * 3 and c.output_versions == [3] * 3
    assert stats["malformed"] == 1 and stats["retries"] == 1 and stats["completed"] == 1


# The HTTP itself is hostile or broken.
async def _endless_chunks(writer):
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    for _ in range(10_000):  # 10 MB, far past the 1 MiB cap; the client hangs up first
        writer.write(b"400\r\n" + b"x" * 1024 + b"\r\n")
        await writer.drain()


async def _truncated(writer):
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n" + honest_body())
    await writer.drain()


BAD_HTTP = {
    "content_length_over_cap": (http(b"{}", extra=b"X-Pad: 1\r\n").replace(
        b"Content-Length: 2", b"Content-Length: 9999999999"), "malformed"),
    "body_over_cap": (http(b'{"pad":"' + b"x" * (2 << 20) + b'"}'), "malformed"),
    "endless_chunked_body": (_endless_chunks, "malformed"),
    "garbage_status_line": (b"HELLO THERE\r\n\r\n", "connection_errors"),
    "bad_chunk_size": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
                       "connection_errors"),
    "negative_chunk_size": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\nabc\r\n0\r\n\r\n",
                            "connection_errors"),
    "chunk_longer_than_its_size": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabcdef\r\n0\r\n\r\n",
                                   "connection_errors"),
    "bad_content_length": (b"HTTP/1.1 200 OK\r\nContent-Length: -3\r\n\r\n{}", "connection_errors"),
    "truncated_body": (_truncated, "connection_errors"),
    "header_block_never_ends": (b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 20_000, "connection_errors"),
}


@pytest.mark.parametrize("case", sorted(BAD_HTTP))
async def test_broken_http_fails_over(case):
    answer, counter = BAD_HTTP[case]
    c, stats = await generate_with_failover(answer)
    assert c.output_ids == HONEST_IDS
    assert stats[counter] == 1 and stats["completed"] == 1


async def test_a_body_of_many_tiny_chunks_is_read_in_linear_time():
    pad = "y" * 300_000
    body = json.dumps({"output_ids": HONEST_IDS, "pad": pad, "meta_info": {
        "finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, t, None] for t in HONEST_IDS]}}).encode()

    async def trickle(writer):  # one-byte chunks, flushed in many small writes
        raw = chunked(body, 1)
        for i in range(0, len(raw), 4096):
            writer.write(raw[i:i + 4096])
            await writer.drain()
        await asyncio.sleep(0.05)

    server = await RawServer(trickle).start()
    try:
        async with SGLangClient([server.addr], cfg(max_response_bytes=8 << 20), vocab_size=VOCAB) as eng:
            await eng.initialize(timeout=5)
            t0 = time.perf_counter()
            c = await eng.agenerate(req())
            took = time.perf_counter() - t0
    finally:
        await server.stop()
    assert c.output_ids == HONEST_IDS
    assert took < 5.0  # ~1.8 MB of framing in ~450 writes; a quadratic parser takes minutes


async def test_a_malicious_server_alone_gives_one_clear_error_and_no_completion():
    evil = await RawServer(BAD_CONTENT["id_at_vocab_size"]).start()
    try:
        async with SGLangClient([evil.addr], cfg(request_retries=1), vocab_size=VOCAB) as eng:
            await eng.initialize(timeout=5)
            with pytest.raises(GenerationError, match=r"malformed.*outside the vocabulary \[0, 100\)"):
                await eng.agenerate(req())
            assert eng.stats()["malformed"] == 2 and eng.stats()["completed"] == 0
    finally:
        await evil.stop()


async def test_an_oversized_server_info_is_a_clear_startup_error():
    evil = await RawServer().start()
    evil.info = b'{"version": "0.5.23", "pad": "' + b"z" * (2 << 20) + b'"}'
    try:
        async with SGLangClient([evil.addr], cfg(), vocab_size=VOCAB) as eng:
            with pytest.raises(ServerStartupError, match="max_response_bytes"):
                await eng.initialize(timeout=5)
    finally:
        await evil.stop()


# --------------------------------------------------------------- the check alone


def seg(ids, lps=None, version=0):
    return Segment(ids, [-0.1] * len(ids) if lps is None else lps, "length", version)


@pytest.mark.parametrize("segment,why", [
    (seg([1, 2], [-0.1]), "2 output tokens but 1 log-probs"),
    (seg([1, 2, 3, 4, 5]), "budget of 4"),
    (seg([1, VOCAB]), "outside the vocabulary"),
    (seg([1, None]), "NoneType, not an int"),
    (seg([1, 2], [-0.1, float("nan")]), "not a finite number"),
    (seg([1, 2], [-0.1, float("-inf")]), "not a finite number"),
    (seg([1, 2], [-0.1, 1e-2]), "not a finite number <= 0"),
    (seg([1, 2], [-0.1, None]), "not a number"),
    (seg([1], version=-1), "weight version -1"),
    (Segment([1], [-0.1], "length", 0, [[(1, -0.1), (VOCAB, -2.0)]]), "top log-prob names a token id"),
    (Segment([1], [-0.1], "length", 0, [[(1, -0.1), (2, float("nan"))]]), "top log-prob is not a finite"),
    (Segment([1, 2], [-0.1, -0.1], "length", 0, [[(1, -0.1)]]), "1 positions of top log-probs for 2"),
])
def test_check_segment_names_the_violation(segment, why):
    with pytest.raises(AttemptFailure, match=why) as e:
        check_segment(segment, budget=4, vocab_size=VOCAB)
    assert e.value.kind == "malformed"


def test_check_segment_accepts_possible_answers():
    ok = seg([0, VOCAB - 1, 5], [0.0, -1e-9 + 1e-7, -30.0])  # fp32 rounding a hair above 0 is kept
    assert check_segment(ok, budget=3, vocab_size=VOCAB) is ok
    assert check_segment(seg([], []), budget=1, vocab_size=VOCAB).ids == []
    assert check_segment(seg([10**6]), budget=1, vocab_size=None).ids == [10**6]  # no vocabulary known
