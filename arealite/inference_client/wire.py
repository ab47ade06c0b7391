"""The wire format of an inference backend: the one piece a new backend replaces.

The client core (`remote_client.RemoteInferenceClient`) routes, retries, resubmits
after aborts and tracks server health the same way for every backend. What differs
between SGLang and, say, vLLM is small and lives behind `WireFormat`:

- how one generation request is written (route and JSON body),
- how the answer is read (tokens, log-probs, finish reason, weight version),
- what a server says about itself (release, tensor-parallel size) and on which routes.

Adding a backend is one module with its `WireFormat`, its administration (as
`sglang_admin.py` for SGLang) and the engine that joins them (as `sglang_client.py`),
plus one entry in `arealite.inference_client.backends`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, NoReturn, Protocol, runtime_checkable

from arealite.api.types import SamplingParams
from arealite.utils.json_types import JsonObject, JsonValue

import numpy as np

if TYPE_CHECKING:
    import torch

try:  # orjson is several times faster on token-id lists; plain json is the fallback.
    import orjson

    def dumps(obj: JsonValue) -> bytes:
        return orjson.dumps(obj)

    _parse = orjson.loads  # strict JSON: NaN and Infinity are refused
except ImportError:  # pragma: no cover - exercised only without orjson
    import json

    def dumps(obj: JsonValue) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    def _no_constant(name: str) -> NoReturn:
        raise ValueError(f"{name} is not JSON")

    def _parse(raw: bytes | str) -> JsonValue:
        return json.loads(raw, parse_constant=_no_constant)

#: Deepest nesting accepted in a server's JSON. SGLang's answers nest 4 levels; a recursive
#: parser given a few hundred thousand levels overflows the C stack and kills the process.
MAX_JSON_DEPTH = 512


def _nesting_depth(raw: bytes) -> int:
    """Deepest bracket nesting of ``raw`` (brackets inside strings count too: an over-estimate)."""
    a = np.frombuffer(raw, dtype=np.uint8)
    step = ((a == 91) | (a == 123)).astype(np.int32) - ((a == 93) | (a == 125))
    return int(np.cumsum(step).max(initial=0))


def loads(raw: bytes | str) -> JsonValue:
    """Parse a server's JSON; raise ``ValueError`` for anything that is not strict JSON nested
    at most `MAX_JSON_DEPTH` levels (NaN, Infinity, a bomb of brackets)."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    # Fast path: fewer opening brackets than the limit cannot nest deeper than it.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _nesting_depth(raw) > MAX_JSON_DEPTH:
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return _parse(raw)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


__all__ = ["MAX_JSON_DEPTH", "Segment", "ServerFacts", "WireFormat", "describe", "dumps", "encode_request",
           "error_message", "loads", "snippet"]

JSON_HEADERS = {"Content-Type": "application/json"}


class Segment(NamedTuple):
    """What one ``/generate`` answer holds (one segment of a possibly interrupted completion)."""

    ids: list[int]
    logprobs: list[float]
    finish: str  # stop | length | abort
    version: int | None  # the weight version the server reported; None when it did not
    top: list[list[tuple[int, float]]] | None = None  # per token: (id, log-prob) of the likeliest
    # SGLang's meta_info.routed_experts decoded: int32 [rows * layers * top_k], one row per token the
    # server ran forward (this segment's input and its output but the last); None when not asked.
    routed_experts: torch.Tensor | None = None
    # Per output token, the version that sampled it, when the weights changed under the answer (SGLang's
    # meta_info.weight_versions spans, an in_place or retract pause); None: every token is ``version``'s.
    versions: list[int] | None = None


class ServerFacts(NamedTuple):
    """What the client keeps from a server's self-description."""

    release: str | None  # e.g. "0.5.23"
    version: tuple[int, int, int, int] | None  # the release, parsed (None when unknown)
    tp_size: int  # ranks the server contributes to a weight-update group


@runtime_checkable
class WireFormat(Protocol):
    """How one backend's servers are spoken to (requests and answers only; no I/O)."""

    name: str
    generate_route: str  # POST, body from `generate_body`
    info_routes: tuple[str, ...]  # GET, read once at start-up (`server_facts`); the first served wins
    routes_route: str | None  # GET, the routes a server serves (OpenAPI document), None: not offered
    health_route: str  # GET, 200 = alive and generating (start-up, probes while not paused)
    liveness_routes: tuple[str, ...]  # GET, 200 = alive, never generates (probes while paused)
    ready_route: str | None  # GET, 200 = start-up warm-up over and not paused; None: not offered
    batches: bool  # whether `generate_route` takes several requests in one body (`batch_body`)

    def sampling_params(self, sp: SamplingParams) -> JsonObject:
        """The backend's sampling parameters for `sp` (computed once per request)."""
        ...

    def generate_body(self, input_ids: list[int], params: JsonObject, rid: str,
                      max_new_tokens: int | None = None, top_logprobs: int = 0) -> JsonObject:
        """One generation request; ``max_new_tokens`` overrides ``params``' own when given;
        ``top_logprobs`` > 0 asks for that many likeliest tokens per position."""
        ...

    def parse_generate(self, raw: bytes) -> Segment:
        """Read an answer; raise ``AttemptFailure("malformed", why)`` when it is not one."""
        ...

    def batch_body(self, bodies: list[JsonObject]) -> JsonObject:
        """Several `generate_body` requests as one request (only when `batches`)."""
        ...

    def split_batch(self, raw: bytes, n: int) -> list[JsonValue]:
        """The answer to a `batch_body` of ``n`` requests as ``n`` parsed answers (for
        `parse_answer`); ``AttemptFailure("malformed", why)`` when it is not that."""
        ...

    def parse_answer(self, data: JsonValue) -> Segment:
        """Read one parsed answer (a part of `split_batch`'s), as `parse_generate` reads one."""
        ...

    def server_facts(self, addr: str, info: JsonObject) -> ServerFacts:
        """What `info` (the JSON object of an `info_routes` route) says about server `addr`."""
        ...


# ---------------------------------------------------------------------------
# Small helpers shared by the client and the admin calls
# ---------------------------------------------------------------------------


def encode_request(payload: JsonObject) -> bytes:
    """A request body as JSON; a ``ValueError`` naming the request when it holds a non-JSON
    value (a numpy integer among the token ids, say)."""
    try:
        return dumps(payload)
    except TypeError as e:
        raise ValueError(
            f"request {payload.get('rid')}: GenerationRequest.input_ids must hold Python ints "
            f"(convert with .tolist()): {e}"
        ) from None


def describe(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def snippet(raw: bytes, n: int = 200) -> str:
    text = raw[:n].decode("utf-8", "replace")
    return repr(text) + ("..." if len(raw) > n else "")


def count(x: JsonValue) -> int | str:
    return len(x) if isinstance(x, list) else type(x).__name__


def error_message(raw: bytes) -> str:
    """The server's own words: SGLang puts them in {"error": {"message"}} or {"message"}."""
    try:
        data = loads(raw)
    except ValueError:
        return raw[:500].decode("utf-8", "replace")
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if key in data:
                return str(data[key])
    return raw[:500].decode("utf-8", "replace")
