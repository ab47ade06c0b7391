"""SGLang's wire format (0.5.x), also spoken by arealite's embedded server.

``POST /generate {input_ids, sampling_params, return_logprob: true, rid}`` answers
``{output_ids, meta_info: {finish_reason: {type}, output_token_logprobs: [[lp, id, _]...],
weight_version}}``; ``GET /get_server_info`` tells the release and ``tp_size``.
See "Speaking SGLang" in DESIGN.md.
"""

from __future__ import annotations

import logging
import math
import operator
import re
from typing import TYPE_CHECKING

from arealite.api.types import SamplingParams
from arealite.inference_client.errors import AttemptFailure
from arealite.inference_client.wire import Segment, ServerFacts, count, dumps, loads, snippet
from arealite.utils.json_types import JsonObject, JsonValue

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = ["READBACK_UNSUPPORTED", "SGLangWire", "WEIGHT_UPDATE_BRACKETS_SINCE",
           "has_weight_update_brackets", "parse_prompt_logprobs", "parse_sglang_version", "prompt_score_body"]

#: What SGLang answers (HTTP 400) on ``/get_weights_by_name`` when the model class cannot
#: read its weights back (``WeightExporter.get_weights_by_name`` returned None).
READBACK_UNSUPPORTED = "Get parameter by name failed"

#: First SGLang release with ``/begin_weight_update`` and ``/end_weight_update``.
WEIGHT_UPDATE_BRACKETS_SINCE = (0, 5, 21)

_FINISH_REASONS = ("stop", "length", "abort")

_VERSION_RE = re.compile(
    r"^\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?"
    r"(?:[.\-_]?(?P<tag>a|alpha|b|beta|c|rc|pre|preview|dev|post)\.?\d*)?",
    re.IGNORECASE,
)


def parse_sglang_version(text: JsonValue) -> tuple[int, int, int, int] | None:
    """Parse a release string such as "0.5.23", "0.5.21rc1", "0.5.3.post1".

    Returns ``(major, minor, patch, stage)`` where ``stage`` is -1 for a
    pre-release (a/b/rc/dev), 0 for a release and 1 for a post-release, so that
    tuples order as PEP 440 does ("0.5.21rc1" < "0.5.21" < "0.5.21.post1").
    Returns None when the text holds no version.
    """
    if not isinstance(text, str):
        return None
    m = _VERSION_RE.match(text)
    if m is None:
        return None
    tag = (m.group("tag") or "").lower()
    stage = 1 if tag == "post" else (-1 if tag else 0)
    return (int(m.group(1)), int(m.group(2) or 0), int(m.group(3) or 0), stage)


def has_weight_update_brackets(version: tuple[int, int, int, int] | None) -> bool:
    """Whether a release (parsed) has begin/end_weight_update."""
    return version is not None and version >= (*WEIGHT_UPDATE_BRACKETS_SINCE, 0)


def _weight_version(wv: JsonValue) -> int | None:
    """SGLang reports "default" until the first update_weight_version: that is None. A
    version of any other type (a float, a list, true) is not an answer SGLang gives."""
    if type(wv) is int:
        return wv
    if isinstance(wv, str):
        try:
            return int(wv) if len(wv) <= 32 else None
        except ValueError:
            return None
    if wv is None:
        return None
    raise AttemptFailure("malformed", f"meta_info.weight_version is a {type(wv).__name__} ({wv!r:.40})")


def _token_versions(spans: JsonValue, n: int) -> list[int] | None:
    """Per-token versions from ``meta_info.weight_versions`` (SGLang 0.5.21+: ``[{version, start,
    end}, ...]`` covering the output tokens in order); None when a span's version is unknown."""
    if not isinstance(spans, list):
        raise _malformed(f"meta_info.weight_versions is a {type(spans).__name__}, expected a list of spans")
    out: list[int] = []
    for sp in spans:
        if not (isinstance(sp, dict) and type(sp.get("start")) is int and type(sp.get("end")) is int
                and sp["start"] == len(out) and sp["end"] >= sp["start"]):
            raise _malformed(f"meta_info.weight_versions has span {str(sp)[:80]} after {len(out)} tokens; "
                             "expected {version, start, end} spans covering the output in order")
        v = _weight_version(sp.get("version"))
        if v is None:
            return None
        out += [v] * (sp["end"] - sp["start"])
    if len(out) != n:
        raise _malformed(f"meta_info.weight_versions cover {len(out)} tokens of an answer of {n}")
    return out


def prompt_score_body(input_ids: list[int], rid: str) -> JsonObject:
    """A request that scores ``input_ids`` (their ``input_token_logprobs`` at temperature 1)."""
    return {"input_ids": list(input_ids), "rid": rid, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": 1.0}}


def parse_prompt_logprobs(data: JsonValue, input_ids: list[int]) -> tuple[list[float], int | None]:
    """The log-probs of ``input_ids[1:]`` from an answer to `prompt_score_body`, and the weight
    version that computed them. SGLang gives ``[None, id0, _]`` first, then
    ``[logprob, id, _]`` for each later prompt token (``logprob_result_processor.py``)."""
    if isinstance(data, list) and len(data) == 1:
        data = data[0]
    meta = data.get("meta_info") if isinstance(data, dict) else None
    entries = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    if not isinstance(entries, list) or len(entries) != len(input_ids):
        raise ValueError(f"meta_info.input_token_logprobs has {count(entries)} entries for a prompt of "
                         f"{len(input_ids)} tokens (was logprob_start_len honoured?)")
    lps: list[float] = []
    for i, e in enumerate(entries[1:], start=1):
        if not (isinstance(e, list) and len(e) >= 2 and e[1] == input_ids[i]
                and type(e[0]) in (float, int) and math.isfinite(e[0])):
            raise ValueError(f"meta_info.input_token_logprobs[{i}] is {str(e)[:80]}, expected "
                             f"[logprob, {input_ids[i]}, ...]")
        lps.append(float(e[0]))
    try:
        version = _weight_version(meta.get("weight_version"))
    except AttemptFailure as e:
        raise ValueError(str(e)) from None
    return lps, version


def _text(data: JsonValue, raw: bytes | None) -> str:
    return snippet(raw if raw is not None else dumps(data))


def _malformed(why: str) -> AttemptFailure:
    return AttemptFailure("malformed", why)


_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


def _split_logprobs(token_lps: JsonValue) -> tuple[list[float], list[int]]:
    """``[[logprob, token_id, text-or-null], ...]`` -> (logprobs, token ids)."""
    if not isinstance(token_lps, list):
        raise _malformed("meta_info.output_token_logprobs is missing (was return_logprob honoured?)")
    if not token_lps:
        return [], []
    try:  # column split in C (an aborted segment's hundreds of entries cost ~20 us)
        lps, lp_ids = list(map(_FIRST, token_lps)), list(map(_SECOND, token_lps))
    except (TypeError, IndexError, KeyError):
        lps = lp_ids = None
    if lps is None or None in lps:
        raise _malformed("meta_info.output_token_logprobs entries are not [logprob, token_id, ...]")
    return lps, lp_ids


def _routed_experts(b64: JsonValue) -> torch.Tensor | None:
    """``meta_info.routed_experts`` as a flat int32 tensor (`arealite.moe.wire`, docs/sglang.md)."""
    if b64 is None:
        return None
    from arealite.moe.wire import decode_routed_experts  # imports torch: only for an answer that has routing

    try:
        return decode_routed_experts(b64)
    except ValueError as e:
        raise _malformed(str(e)) from None


def _split_top(top: JsonValue, n: int) -> list[list[tuple[int, float]]]:
    """``output_top_logprobs`` (per position, ``[[logprob, id, text], ...]``) -> (id, logprob) pairs."""
    if not isinstance(top, list) or len(top) != n:
        raise _malformed(f"meta_info.output_top_logprobs has {count(top)} positions for {n} tokens")
    try:
        return [[(e[1], e[0]) for e in pos] for pos in top]
    except (TypeError, IndexError, KeyError):
        raise _malformed("meta_info.output_top_logprobs entries are not [logprob, token_id, ...]") from None


class SGLangWire:
    """`WireFormat` of SGLang 0.5.x (and the embedded server)."""

    name = "sglang"
    generate_route = "/generate"
    info_routes = ("/server_info", "/get_server_info")  # the second is a deprecated alias
    routes_route = "/openapi.json"  # FastAPI's; absent when SGLang runs with DISABLE_OPENAPI_DOC
    # SGLang's /health generates one token: while paused it waits, then fails. The model-info
    # routes answer from the tokenizer manager without generating (newest name first).
    health_route = "/health"
    liveness_routes = ("/model_info", "/get_model_info")
    # 200 once SGLang's start-up warm-up is over (and it is not paused), without generating;
    # used where /openapi.json lists it, else /health (503 until then) tells the same.
    ready_route = "/ready"
    batches = True  # GenerateReqInput: lists of input_ids, sampling_params, rid (`batch_body`)
    #: The LoRA adapter every request runs with (``lora_path``: ``actor.lora.served_name`` in a
    #: LoRA run, the name each push reloads, `arealite.weight_sync.lora_push`); None = the base model.
    lora_path: str | None = None
    #: Ask for the experts an MoE model routed every token to (``return_routed_experts``; the server
    #: needs ``--enable-return-routed-experts``); set for ``algorithm.routing_replay: r3``.
    return_routed_experts: bool = False

    def sampling_params(self, sp: SamplingParams) -> JsonObject:
        return sp.to_sglang()

    def generate_body(self, input_ids: list[int], params: JsonObject, rid: str,
                      max_new_tokens: int | None = None, top_logprobs: int = 0) -> JsonObject:
        if max_new_tokens is not None:
            params = {**params, "max_new_tokens": max_new_tokens}
        body = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True, "rid": rid}
        if top_logprobs:
            body["top_logprobs_num"] = top_logprobs
        if self.lora_path is not None:
            body["lora_path"] = self.lora_path
        if self.return_routed_experts:
            body["return_routed_experts"] = True
        return body

    def batch_body(self, bodies: list[JsonObject]) -> JsonObject:
        """`generate_body` requests as one: SGLang's batch form (``GenerateReqInput`` takes a
        list per field, one entry per prompt, and answers a list in the same order)."""
        body: JsonObject = {
            "input_ids": [b["input_ids"] for b in bodies],
            "sampling_params": [b["sampling_params"] for b in bodies],
            "return_logprob": True,
            "rid": [b["rid"] for b in bodies],
        }
        if any("top_logprobs_num" in b for b in bodies):
            body["top_logprobs_num"] = [b.get("top_logprobs_num", 0) for b in bodies]
        if any("image_data" in b for b in bodies):  # one list per request; [] = a text-only one
            body["image_data"] = [b.get("image_data", []) for b in bodies]
        if self.lora_path is not None:
            body["lora_path"] = [self.lora_path] * len(bodies)
        if self.return_routed_experts:
            body["return_routed_experts"] = True
        return body

    def split_batch(self, raw: bytes, n: int) -> list[JsonValue]:
        """The answers to a `batch_body` of ``n`` requests, one parsed object each."""
        try:
            data = loads(raw)
        except ValueError as e:
            raise _malformed(f"response is not JSON ({e}): {snippet(raw)}") from None
        if not isinstance(data, list) or len(data) != n:
            got = f"{len(data)} entries" if isinstance(data, list) else f"a {type(data).__name__}"
            raise _malformed(f"a batch of {n} requests was answered by {got}: {snippet(raw)}")
        return data

    def parse_generate(self, raw: bytes) -> Segment:
        try:
            data = loads(raw)
        except ValueError as e:
            raise _malformed(f"response is not JSON ({e}): {snippet(raw)}") from None
        if isinstance(data, list) and len(data) == 1:
            data = data[0]
        return self.parse_answer(data, raw)

    def parse_answer(self, data: JsonValue, raw: bytes | None = None) -> Segment:
        """One parsed answer (``raw``: its text, for error messages; None: a batch's part)."""
        if not isinstance(data, dict):
            raise _malformed(f"response is {type(data).__name__}, not an object: {_text(data, raw)}")
        meta = data.get("meta_info")
        if not isinstance(meta, dict):
            raise _malformed(f"response has no 'meta_info' object: {_text(data, raw)}")
        fr = meta.get("finish_reason")
        finish = fr.get("type") if isinstance(fr, dict) else fr
        if finish not in _FINISH_REASONS:
            raise _malformed(f"meta_info.finish_reason is {fr!r}; expected type stop, length or abort")
        lps, lp_ids = _split_logprobs(meta.get("output_token_logprobs"))
        ids = data.get("output_ids")
        if ids is None:
            ids = lp_ids
        elif ids != lp_ids:
            raise _malformed(f"output_ids ({count(ids)} tokens) disagree with "
                             f"meta_info.output_token_logprobs ({len(lp_ids)} tokens)")
        if ids and (type(ids[0]) is not int or type(lps[0]) not in (float, int)):
            raise _malformed(f"output tokens/logprobs have types {type(ids[0]).__name__}/"
                             f"{type(lps[0]).__name__}, expected int/float")
        top = meta.get("output_top_logprobs")
        spans = meta.get("weight_versions")
        return Segment(ids, lps, finish, _weight_version(meta.get("weight_version")),
                       None if top is None else _split_top(top, len(ids)),
                       _routed_experts(meta.get("routed_experts")),
                       None if spans is None or (type(spans) is list and len(spans) < 2)
                       else _token_versions(spans, len(ids)))

    def server_facts(self, addr: str, info: JsonObject) -> ServerFacts:
        release = info.get("version") if isinstance(info.get("version"), str) else None
        version = parse_sglang_version(release)
        if version is None:
            logger.warning(
                "%s: the server info has no parsable 'version' (%r); the routes it serves "
                "(/openapi.json) decide which optional routes are used, else none before %s",
                addr, info.get("version"), ".".join(map(str, WEIGHT_UPDATE_BRACKETS_SINCE)),
            )
        tp = info.get("tp_size", 1)
        return ServerFacts(release, version, tp if isinstance(tp, int) and tp >= 1 else 1)
