"""How closely the embedded server behaves like SGLang where SGLang is unforgiving.

A stand-in that forgives what SGLang punishes hides client bugs until the day a GPU
run meets the real server. Two layers, each following SGLang 0.5.21-0.5.23's source:

Always (whatever the mode), as SGLang's releases that have the routes:

- **Weight-update sessions** (``managers/scheduler_components/weight_updater.py``,
  ``begin_weight_update`` / ``end_weight_update`` / ``update_weights_from_distributed``):
  ``/begin_weight_update`` while a session is open, ``/end_weight_update`` without one,
  and ``/update_weights_from_distributed`` outside one are refused with a 400 whose
  message is SGLang's, and a session left open stays open: every later begin fails
  until someone ends it. (The scheduler returns ``success=False``; it does not assert.)
  A server reporting a release before 0.5.21 (``--sglang-version``) has no begin/end
  routes (404) and takes distributed updates without a session, as those releases did.
- **Route discovery**: ``/server_info`` and its deprecated alias ``/get_server_info``,
  ``/model_info`` and ``/get_model_info`` (``entrypoints/http_server.py``), and
  ``/openapi.json`` listing every route, as FastAPI serves it (off when the
  ``DISABLE_OPENAPI_DOC`` environment variable is true, as in SGLang).

- **Per-bucket relabelling** (``update_weights_from_distributed`` in
  ``managers/tokenizer_control_mixin.py``): every successful call that carries a
  ``weight_version`` relabels the server at once, so a push that fails after its first
  bucket leaves the new label over mixed weights unless only its last bucket carries it.

- **Pause modes** (``Scheduler.pause_generation`` / ``flush_cache`` in ``managers/scheduler.py``,
  ``flush_cache_after_weight_update`` in ``managers/scheduler_components/weight_updater.py``):
  ``abort``, ``retract`` and ``in_place``; paused ``in_place`` with requests frozen in the batch,
  ``/flush_cache`` answers 400 and a weight load asking for a flush (``flush_cache`` true, the
  default) is refused with a 400 before loading (SGLang 0.5.21's scheduler dies on it, 0.5.23
  loads and answers ``success: false``). Every answer carries ``meta_info.weight_versions``.

Strict mode only (``--strict-sglang``; on in the suite's end-to-end and fault tests):

- **The start-up warm-up** (``_wait_and_warmup`` / ``_execute_server_warmup`` in
  ``entrypoints/http_server.py``): once the HTTP server is up, SGLang sends itself one
  ``/generate`` (8 greedy tokens); until it has its answer ``/health`` answers 503 at once
  and ``/ready`` 503, while ``/model_info`` already answers. The warm-up's request waits like
  any other while generation is paused, and when it has no answer within
  ``SGLANG_WARMUP_TIMEOUT`` seconds (``srt/environ.py``; -1, the default, means 600) the
  server kills itself. ``--warmup-delay-s`` sets how long the stand-in takes before sending
  it (a slow-warming server); ``--skip-server-warmup`` (SGLang's flag) skips it.

- **/health generates** (``health_generate`` in ``http_server.py``): one greedy token,
  unless ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` is false (``srt/environ.py``,
  default true). While generation is paused it waits, and after
  ``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds (default 20) answers 503.
- **Read-back works only for some model classes** (``WeightExporter.get_weights_by_name``
  returns None when the model class has no ``get_weights_by_name``; the route then answers
  400 ``{"error": {"message": "Get parameter by name failed"}}``). The classes that have
  it in 0.5.23 are ``READBACK_ARCHITECTURES``; Qwen2/Qwen3 are not among them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: Model classes of SGLang 0.5.23 that implement ``get_weights_by_name``
#: (``srt/models/{llama,mistral,opt,granite,exaone4}.py`` and Llama's subclasses).
READBACK_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "InternLM3ForCausalLM",
    "OPTForCausalLM", "GraniteForCausalLM", "Exaone4ForCausalLM",
})

#: First SGLang release with weight-update sessions (``/begin_weight_update``).
SESSIONS_SINCE = (0, 5, 21)

#: The readback failure's message, as SGLang words it.
READBACK_FAILED = "Get parameter by name failed"

SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION = "no weight-update session is open; call begin_weight_update() first"
OUTSIDE_SESSION = ("update_weights_from_distributed must run between "
                   "begin_weight_update() and end_weight_update()")


def _env_bool(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None or not v.strip():
        return default
    return v.strip().lower() in ("1", "true", "yes", "on")


def _warmup_timeout() -> float:
    """``SGLANG_WARMUP_TIMEOUT`` as SGLang reads it: a positive number of seconds, else 600."""
    text = os.environ.get("SGLANG_WARMUP_TIMEOUT", "").strip()
    try:
        value = float(text) if text else -1.0
    except ValueError:
        value = -1.0
    return value if value > 0 else 600.0


def _release_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


@dataclass(frozen=True)
class SGLangBehaviour:
    """The SGLang behaviours one embedded server follows (see the module's docstring)."""

    release: str = "0.5.23"
    """The SGLang release the server reports (``version`` in ``/server_info``)."""
    strict: bool = False
    health_generates: bool = False
    health_timeout_s: float = 20.0
    readback_architectures: frozenset[str] | None = None
    """Model classes whose weights can be read back (None: every class)."""
    openapi: bool = True
    warmup: bool = False
    """Whether the server runs SGLang's start-up warm-up (and is not ready until it is over)."""
    warmup_delay_s: float = 0.0
    """How long after start-up the warm-up's request goes out (a slow-warming server)."""
    warmup_timeout_s: float = 600.0
    """How long the warm-up's request may wait for its answer before the server kills itself."""

    @classmethod
    def from_flags(cls, *, strict: bool, release: str, readback: str | None, skip_warmup: bool = False,
                   warmup_delay_s: float = 0.0) -> "SGLangBehaviour":
        """Build it from the server's flags and SGLang's environment variables."""
        if readback is not None:
            archs: frozenset[str] | None = frozenset(a.strip() for a in readback.split(",") if a.strip())
            if "all" in archs:
                archs = None
        else:
            archs = READBACK_ARCHITECTURES if strict else None
        timeout = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20") or 20)
        return cls(
            release=release, strict=strict,
            health_generates=strict and _env_bool("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", True),
            health_timeout_s=timeout,
            readback_architectures=archs,
            openapi=not _env_bool("DISABLE_OPENAPI_DOC", False),
            warmup=strict and not skip_warmup,
            warmup_delay_s=float(warmup_delay_s),
            warmup_timeout_s=_warmup_timeout(),
        )

    @property
    def has_sessions(self) -> bool:
        """Whether the reported release has begin/end_weight_update (and requires them).

        A build from source without a version reports "0.0.0.dev0" (``sglang/version.py``)
        and is the newest code: it has them, which is why clients must not decide by release.
        """
        return _release_tuple(self.release) >= SESSIONS_SINCE or "dev" in self.release

    def can_read_back(self, architectures: list[str] | None) -> bool:
        """Whether ``get_weights_by_name`` works for a model of these architectures."""
        if self.readback_architectures is None:
            return True
        return any(a in self.readback_architectures for a in architectures or ())
