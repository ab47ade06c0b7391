"""Parsing a ``/generate`` request: its body, its sampling parameters, its size caps.

Validation follows SGLang: an unknown key is a 400; a key SGLang knows but this
server does not implement is accepted only at its neutral value (e.g.
``repetition_penalty: 1.0``) and is otherwise a 400 saying it is not supported,
so that nothing a client asks for is silently ignored. Every error names the field.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Callable, TypeGuard

from arealite.utils.json_types import JsonObject, JsonValue

from .limits import CHARS_PER_TOKEN, short
from .sampling import SamplingConfig

SEED_BOUND = 2 ** 64


class RequestError(ValueError):
    """A bad request: answered with HTTP 400 and this message."""


@dataclass
class GenerateInput:
    """One sequence to generate (a batch request is split into several)."""

    rid: str
    input_ids: list[int]
    sampling: SamplingConfig
    return_logprob: bool = False
    logprob_start_len: int = -1
    """First prompt position whose log-prob is returned (``input_token_logprobs``); -1: none."""
    top_logprobs_num: int = 0
    """Most likely tokens reported at each generated position (``output_top_logprobs``)."""
    return_routed_experts: bool = False
    """Return the experts routed per token and MoE layer (``meta_info.routed_experts``)."""
    lora: object = None
    """The LoRA adapter the sequence runs with (``lora_path``; `arealite.server.lora_adapters`); None: the base."""
    vision: object = None
    """The prompt's images (`arealite.server.vision.VisionInputs`); None: text only."""


# --------------------------------------------------------------------------
# Validation helpers: each names the field it checks.
# --------------------------------------------------------------------------


def _is_int(v: JsonValue) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: JsonValue) -> TypeGuard[int | float]:
    if isinstance(v, int) and not isinstance(v, bool):
        return abs(v) < 2 ** 1000  # math.isfinite(10**400) raises OverflowError
    return isinstance(v, float) and math.isfinite(v)


def _want_int(name: str, v: JsonValue, lo: int | None = None) -> int:
    if not _is_int(v):
        raise RequestError(f"{name} must be an integer, got {short(v)}")
    if lo is not None and v < lo:
        raise RequestError(f"{name} must be >= {lo}, got {v}")
    return v


def _want_number(name: str, v: JsonValue) -> float:
    if not _is_number(v):
        raise RequestError(f"{name} must be a finite number, got {short(v)}")
    return float(v)


def _want_bool(name: str, v: JsonValue) -> bool:
    if not isinstance(v, bool):
        raise RequestError(f"{name} must be true or false, got {short(v)}")
    return v


# Keys SGLang 0.5.23 knows in sampling_params that this server does not
# implement, with the test for "neutral value" (equal to not setting it).
_UNSUPPORTED_SAMPLING: dict[str, Callable[[JsonValue], bool]] = {
    "stop": lambda v: v is None or v == "" or v == [],
    "stop_regex": lambda v: v is None or v == "" or v == [],
    "frequency_penalty": lambda v: v is None or (_is_number(v) and v == 0),
    "presence_penalty": lambda v: v is None or (_is_number(v) and v == 0),
    "repetition_penalty": lambda v: v is None or (_is_number(v) and v == 1),
    "min_new_tokens": lambda v: v is None or (_is_int(v) and v == 0),
    "json_schema": lambda v: v is None,
    "regex": lambda v: v is None,
    "ebnf": lambda v: v is None,
    "structural_tag": lambda v: v is None,
    "logit_bias": lambda v: v is None or v == {},
    "custom_params": lambda v: v is None or v == {},
    # Streaming is not supported, so the interval is meaningless but harmless.
    "stream_interval": lambda v: v is None or (_is_int(v) and v >= 1),
}

_SUPPORTED_SAMPLING = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop_token_ids", "ignore_eos",
    "sampling_seed", "n", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
}

# Top-level /generate keys SGLang knows that this server does not implement
# (accepted only at their neutral value).
_UNSUPPORTED_TOP: dict[str, Callable[[JsonValue], bool]] = {
    "stream": lambda v: v is None or v is False,
    "token_ids_logprob": lambda v: v is None,
    "return_text_in_logprobs": lambda v: v is None or v is False,
    "return_hidden_states": lambda v: v is None or v is False,
    "log_metrics": lambda v: v is None or isinstance(v, bool),
    # accepted unset only
    **dict.fromkeys(("image_data", "video_data", "audio_data", "input_embeds", "session_params",
                     "custom_logit_processor", "modalities", "bootstrap_host", "bootstrap_port",
                     "bootstrap_room", "data_parallel_rank", "priority"), lambda v: v is None),
}
_SUPPORTED_TOP = {"text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
                  "top_logprobs_num", "lora_path", "return_routed_experts"}  # lora_path: checked by arealite.server.lora_adapters

# Top-level keys SGLang 0.5.23 declares (``GenerateReqInput`` and the JSON contract
# ``sglang.api.v1.GenerateRequest``). Keys it does not declare are ignored there, not
# refused (``GenerateRequest`` says "unknown keys ignored"), and SGLang's router adds
# some of its own (``model``, ``background``, ``no_logs``, ...): they are ignored here too.
_IGNORED_TOP_NEUTRAL: dict[str, Callable[[JsonValue], bool]] = {
    "return_prompt_token_ids": lambda v: v is None or v is False,
    "routed_experts_start_len": lambda v: v is None or v == 0,
    "return_sampling_mask": lambda v: v is None or v is False,
    "custom_labels": lambda v: v is None or isinstance(v, dict),
    "routing_key": lambda v: v is None or isinstance(v, str),
    "session_id": lambda v: v is None or isinstance(v, str),
    "extra_key": lambda v: v is None or isinstance(v, (str, list)),
    "cache_salt": lambda v: v is None or isinstance(v, (str, list)),
}


def parse_sampling_params(sp: JsonValue, vocab_size: int, where: str = "sampling_params") -> SamplingConfig:
    """Validate one ``sampling_params`` object."""
    if sp is None:
        return SamplingConfig()
    if not isinstance(sp, dict):
        raise RequestError(f"{where} must be a JSON object, got {type(sp).__name__}")
    out = SamplingConfig()
    for key, v in sp.items():
        name = f"{where}.{key}"
        if key in _UNSUPPORTED_SAMPLING:
            if not _UNSUPPORTED_SAMPLING[key](v):
                raise RequestError(f"{name}={short(v)} is not supported by the arealite embedded server (leave it unset)")
            continue
        if key not in _SUPPORTED_SAMPLING:
            known = sorted(_SUPPORTED_SAMPLING | set(_UNSUPPORTED_SAMPLING))
            raise RequestError(f"{name}: unknown sampling parameter; known: {known}")
        if v is None:
            continue  # SGLang: null means the default
        if key == "max_new_tokens":
            out.max_new_tokens = _want_int(name, v, lo=0)
        elif key == "temperature":
            out.temperature = _want_number(name, v)
            if out.temperature < 0:
                raise RequestError(f"{name} must be >= 0, got {v}")
        elif key == "top_p":
            out.top_p = _want_number(name, v)
            if not 0 < out.top_p <= 1:
                raise RequestError(f"{name} must be in (0, 1], got {v}")
        elif key == "top_k":
            out.top_k = _want_int(name, v)
            if out.top_k < 1 and out.top_k != -1:
                raise RequestError(f"{name} must be -1 (all tokens) or at least 1, got {v}")
        elif key == "min_p":
            out.min_p = _want_number(name, v)
            if not 0 <= out.min_p <= 1:
                raise RequestError(f"{name} must be in [0, 1], got {v}")
        elif key == "stop_token_ids":
            if not isinstance(v, list):
                raise RequestError(f"{name} must be a list of token ids, got {short(v)}")
            for t in v:
                if not _is_int(t) or not 0 <= t < vocab_size:
                    raise RequestError(f"{name}: {short(t)} is not a token id in [0, {vocab_size})")
            out.stop_token_ids = tuple(v)
        elif key == "ignore_eos":
            out.ignore_eos = _want_bool(name, v)
        elif key == "sampling_seed":
            out.sampling_seed = _want_int(name, v, lo=0)
            if out.sampling_seed >= SEED_BOUND:  # torch.Generator.manual_seed takes 64 bits
                raise RequestError(f"{name} must be below 2**64, got {short(v)}")
        elif key == "n":
            if _want_int(name, v) != 1:
                raise RequestError(f"{name}={v}: only n=1 is supported; send n separate requests (or a batch)")
        elif key == "skip_special_tokens":
            out.skip_special_tokens = _want_bool(name, v)
        elif key == "spaces_between_special_tokens":
            out.spaces_between_special_tokens = _want_bool(name, v)
        elif key == "no_stop_trim":
            out.no_stop_trim = _want_bool(name, v)
    return out


def _check_ids(name: str, ids: JsonValue, vocab_size: int) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise RequestError(f"{name} must be a non-empty list of token ids")
    for t in ids:
        if not _is_int(t):
            raise RequestError(f"{name}: {short(t)} is not an integer token id")
        if not 0 <= t < vocab_size:
            raise RequestError(f"{name}: token id {short(t)} is out of the vocabulary [0, {vocab_size})")
    return ids


def _check_top_level(body: JsonObject) -> None:
    """Refuse a known feature this server lacks; ignore keys SGLang does not know (as it does)."""
    for key, v in body.items():
        check = _UNSUPPORTED_TOP.get(key) or _IGNORED_TOP_NEUTRAL.get(key)
        if check is not None and not check(v):
            if key == "image_data":  # SGLang would drop the images of a text-only model silently
                raise RequestError("image_data is not supported: the arealite embedded server runs text-only "
                                   "models; serve a vision-language model with SGLang (docs/sglang.md, Images)")
            raise RequestError(f"{key}={short(v)} is not supported by the arealite embedded server "
                               "(leave it unset)")


def _prompts(body: JsonObject, vocab_size: int, encode: Callable[[str], list[int]] | None,
             caps: "RequestCaps") -> tuple[list[list[int]], bool]:
    """The token ids of every prompt (``text`` encoded, or ``input_ids``) and whether it is a batch.

    Sizes are checked before any per-token work: a request over a cap costs nothing more.
    """
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise RequestError("give exactly one of input_ids or text")
    if text is not None:
        if encode is None:
            raise RequestError("text: no tokenizer is loaded (server started with --skip-tokenizer-init); send input_ids")
        batch = isinstance(text, list)
        texts = text if batch else [text]
        if batch and not texts:
            raise RequestError("text: an empty batch")
        caps.check_batch(len(texts), "text")
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise RequestError(f"{_item('text', i, batch)} must be a string, got {type(t).__name__}")
        caps.check_chars(texts, batch)
        return [_check_ids(_item("text", i, batch) + " (tokenized)", encode(t), vocab_size)
                for i, t in enumerate(texts)], batch
    if not isinstance(input_ids, list) or not input_ids:
        raise RequestError("input_ids must be a non-empty list of token ids (or a list of such lists)")
    if isinstance(input_ids[0], list):
        caps.check_batch(len(input_ids), "input_ids")
        caps.check_tokens(sum(len(ids) if isinstance(ids, list) else 1 for ids in input_ids), "the prompts")
        return [_check_ids(f"input_ids[{i}]", ids, vocab_size) for i, ids in enumerate(input_ids)], True
    caps.check_tokens(len(input_ids), "the prompt")
    return [_check_ids("input_ids", input_ids, vocab_size)], False


def _item(name: str, i: int, batch: bool) -> str:
    return f"{name}[{i}]" if batch else name


@dataclass(frozen=True)
class RequestCaps:
    """The size caps of one ``/generate`` request (``arealite.server.limits.Limits``)."""

    max_prompts: int = 1024
    max_request_tokens: int = 1 << 20
    context_length: int = 1 << 20

    def check_batch(self, n: int, name: str) -> None:
        if n > self.max_prompts:
            raise RequestError(f"{name}: a batch of {n} prompts exceeds the server's cap of {self.max_prompts} "
                               "(server.max_prompts_per_request / --max-prompts); split it into smaller requests")

    def check_tokens(self, n: int, what: str) -> None:
        if n > self.max_request_tokens:
            raise RequestError(f"{what} and completions ask for {n} tokens, above the server's cap of "
                               f"{self.max_request_tokens} per request (server.max_request_tokens / "
                               "--max-request-tokens); split the request")

    def check_chars(self, texts: list[str], batch: bool) -> None:
        """Refuse texts too long to fit the context (or the request cap) before tokenizing them,
        and texts that are not valid Unicode (lone surrogates, which no tokenizer takes)."""
        per_text = CHARS_PER_TOKEN * self.context_length
        total = 0
        for i, t in enumerate(texts):
            if len(t) > per_text:
                raise RequestError(f"{_item('text', i, batch)}: {len(t)} characters cannot fit the context length "
                                   f"{self.context_length}; shorten it")
            total += len(t)
            try:
                t.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(f"{_item('text', i, batch)}: invalid Unicode at character {e.start} "
                                   "(a lone surrogate); send valid UTF-8 text") from None
        if total > CHARS_PER_TOKEN * self.max_request_tokens:
            self.check_tokens(total // CHARS_PER_TOKEN, "the texts")


def _rids(rid: JsonValue, batch: bool, n: int) -> list[str]:
    """One request id per sequence: the given ones, or fresh ones."""
    if batch:
        if rid is None:
            return [uuid.uuid4().hex for _ in range(n)]
        if isinstance(rid, list) and len(rid) == n and all(isinstance(r, str) for r in rid):
            return rid
        raise RequestError(f"rid: a batch of {n} needs a list of {n} strings")
    if rid is not None and not isinstance(rid, str):
        raise RequestError(f"rid must be a string, got {short(rid)}")
    return [rid or uuid.uuid4().hex]


MAX_TOP_LOGPROBS = 64


def _top_logprobs_num(v: JsonValue, return_logprob: bool) -> int:
    """SGLang reports top log-probs only with ``return_logprob`` (0 otherwise)."""
    if v is None:
        return 0
    if not _is_int(v) or not 0 <= v <= MAX_TOP_LOGPROBS:
        raise RequestError(f"top_logprobs_num must be an int in [0, {MAX_TOP_LOGPROBS}], got {short(v)}")
    return v if return_logprob else 0


def _logprob_start(v: JsonValue, return_logprob: bool, prompt_len: int) -> int:
    """``logprob_start_len``: -1 (or unset) returns no prompt log-probs; else a prompt position."""
    if v is None or v == -1 or not return_logprob:
        return -1
    if not _is_int(v) or not 0 <= v < prompt_len:
        raise RequestError(f"logprob_start_len must be -1 or a prompt position in [0, {prompt_len}), got {short(v)}")
    return v


def _routed_experts(v: JsonValue, enabled: bool) -> bool:
    """``return_routed_experts``: only a server started with ``--enable-return-routed-experts`` records them."""
    asked = _want_bool("return_routed_experts", False if v is None else v)
    if asked and not enabled:
        raise RequestError("return_routed_experts: this server does not record routed experts; start it with "
                           "--enable-return-routed-experts (and serve a mixture-of-experts model)")
    return asked


def _fit_context(sc: SamplingConfig, explicit: bool, prompt_len: int, context_length: int,
                 where: str, name: str) -> None:
    """Shrink a default ``max_new_tokens`` to the context left; refuse an explicit one that overflows."""
    if not explicit:  # the default never overflows: it shrinks to what the context leaves
        sc.max_new_tokens = max(0, min(sc.max_new_tokens, context_length - prompt_len))
    total = prompt_len + sc.max_new_tokens
    if total > context_length:
        raise RequestError(
            f"{where}.max_new_tokens: the prompt ({prompt_len} tokens, {name}) plus max_new_tokens "
            f"({sc.max_new_tokens}) = {total} exceeds the context length {context_length}; "
            "lower max_new_tokens or shorten the prompt"
        )


def parse_generate(
    body: JsonValue,
    *,
    vocab_size: int,
    context_length: int,
    encode: Callable[[str], list[int]] | None,
    caps: RequestCaps | None = None,
    routed_experts: bool = False,
) -> tuple[list[GenerateInput], bool]:
    """Validate a ``/generate`` body; return its sequences and whether it was a batch.

    ``encode`` turns text into token ids (None when no tokenizer is loaded); ``caps``
    bounds the request's size (default: `RequestCaps`'s defaults); ``routed_experts``: whether
    the server records routed experts (``--enable-return-routed-experts``).
    """
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    caps = caps or RequestCaps(context_length=context_length)
    _check_top_level(body)
    prompts, batch = _prompts(body, vocab_size, encode, caps)
    n = len(prompts)

    def per_item(key: str, value: JsonValue, is_item: Callable[[JsonValue], bool]) -> list[JsonValue]:
        if batch and isinstance(value, list) and not is_item(value):
            if len(value) != n:
                raise RequestError(f"{key}: a batch of {n} needs {n} values, got {len(value)}")
            return value
        return [value] * n

    sps = per_item("sampling_params", body.get("sampling_params"), lambda v: isinstance(v, dict))
    lps = per_item("return_logprob", body.get("return_logprob", False), lambda v: isinstance(v, bool))
    rids = _rids(body.get("rid"), batch, n)
    starts = per_item("logprob_start_len", body.get("logprob_start_len"), _is_int)
    tops = per_item("top_logprobs_num", body.get("top_logprobs_num"), _is_int)
    routed = per_item("return_routed_experts", body.get("return_routed_experts", False), lambda v: isinstance(v, bool))

    out = []
    for i in range(n):
        where = f"sampling_params[{i}]" if batch and isinstance(body.get("sampling_params"), list) else "sampling_params"
        sc = parse_sampling_params(sps[i], vocab_size, where)
        lp = lps[i] if lps[i] is not None else False
        if not isinstance(lp, bool):
            raise RequestError(f"return_logprob must be true or false, got {short(lp)}")
        explicit = isinstance(sps[i], dict) and sps[i].get("max_new_tokens") is not None
        _fit_context(sc, explicit, len(prompts[i]), context_length, where,
                     f"input_ids[{i}]" if batch else "input_ids")
        start = _logprob_start(starts[i], lp, len(prompts[i]))
        if start >= 0 and sc.max_new_tokens == 0:
            raise RequestError(f"{where}.max_new_tokens=0 with logprob_start_len: this server scores a "
                               "prompt while generating; ask for max_new_tokens >= 1")
        out.append(GenerateInput(rid=rids[i], input_ids=list(prompts[i]), sampling=sc, return_logprob=lp,
                                 logprob_start_len=start, top_logprobs_num=_top_logprobs_num(tops[i], lp),
                                 return_routed_experts=_routed_experts(routed[i], routed_experts)))
    caps.check_tokens(sum(len(x.input_ids) + x.sampling.max_new_tokens for x in out), "the prompts")
    return out, batch
