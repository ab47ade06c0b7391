"""Command-line arguments of the embedded server (a subset of SGLang's flags)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from .limits import Limits, normalize_origin

ENV_API_KEY = "AREALITE_SERVER_API_KEY"


@dataclass
class ServerArgs:
    """How to run one embedded inference server.

    Flag names follow ``python -m sglang.launch_server`` where the two overlap,
    so that the launcher builds both commands the same way.
    """

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str = "auto"
    """``auto`` (the checkpoint's dtype), ``float32``, ``bfloat16`` or ``float16``."""
    quantization: str | None = None
    """``fp8``: serve the linear layers' weights as block-wise float8_e4m3fn with their
    ``weight_scale_inv`` (`arealite.server.fp8_linear`), as SGLang's ``--quantization fp8``."""
    random_seed: int = 0
    """Seeds the shared sampling generator (requests without ``sampling_seed``)."""
    api_key: str | None = None
    """When set, every route except the ``/health*`` probes needs ``Authorization: Bearer <key>``."""
    max_batch_size: int = 64
    """Most sequences decoded together; further requests queue."""
    prompt_cache_entries: int = 64
    """Prompts whose KV cache is kept between admissions (`arealite.server.prompt_cache`); 0: none."""
    context_length: int | None = None
    """Longest prompt + completion; defaults to the model's ``max_position_embeddings``."""
    device: str = "auto"
    """``auto`` (CUDA when present, else CPU), ``cpu`` or ``cuda``."""
    enable_return_routed_experts: bool = False
    """Record the experts a mixture-of-experts model routes every token to, so that requests may ask
    for them (``return_routed_experts``; SGLang's flag of the same name, docs/sglang.md)."""
    skip_tokenizer_init: bool = False
    """Do not load the tokenizer: ``text`` inputs are refused and no ``text`` is returned."""
    weight_version: str = "0"
    """The weight version reported before any update."""
    weight_sync_timeout_s: float = 600.0
    """Timeout of the weight-update process group (rendezvous and broadcasts)."""
    log_level: str = "info"
    strict_sglang: bool = False
    """Behave as SGLang does where it is unforgiving (see ``arealite.server.strict``)."""
    sglang_version: str = "0.5.23"
    """The SGLang release to report and emulate (before 0.5.21: no weight-update sessions)."""
    enable_memory_saver: bool = False
    """SGLang's flag: allow ``/release_memory_occupation``. The embedded server frees its weights
    and KV cache with or without it; under ``--strict-sglang`` a release without it is refused
    (SGLang would answer 200 and free nothing; `arealite.server.memory_routes`)."""
    enable_weights_cpu_backup: bool = False
    """SGLang's flag: keep released weights' contents in host memory (else they come back as
    zeros and the trainer pushes weights before generating; on a CPU device nothing is freed)."""
    readback_architectures: str | None = None
    """Model classes whose weights ``/get_weights_by_name`` reads back, comma-separated
    (``all``); default: every class, or SGLang's list under ``--strict-sglang``."""
    max_body_bytes: int = Limits.max_body_bytes
    """Largest request body (bytes); see `arealite.server.limits.Limits` for this and the next."""
    max_prompts: int = Limits.max_prompts
    max_request_tokens: int = Limits.max_request_tokens
    idle_timeout_s: float = Limits.idle_timeout_s
    body_timeout_s: float = Limits.body_timeout_s
    allowed_origins: str = ""
    """Comma-separated browser origins allowed to call the server (default none)."""
    max_image_bytes: int = 32 << 20
    """Largest encoded image (bytes) in a request's ``image_data`` (vision models, `arealite.server.vision`)."""
    max_image_pixels: int = 4096 * 4096
    """Most decoded pixels of one image, read from its header before decoding."""
    api_key_file: str | None = None
    """File holding the API key (read at start; the key itself never goes on a command line)."""
    api_key_on_argv: bool = False
    """Whether the key came from ``--api-key`` on the command line (warned about at start)."""
    skip_server_warmup: bool = False
    """Strict mode: skip SGLang's start-up warm-up (ready at once), as SGLang's flag of that name."""
    warmup_delay_s: float = 0.0
    """Strict mode: seconds before the start-up warm-up's request goes out (models a slow warm-up)."""
    freeze_gc: bool = True
    """Once loaded, keep the garbage collector off the startup heap (`arealite.utils.heap`)."""

    def served_context_length(self, model_config: object) -> int:
        """The longest prompt + completion served: ``--context-length``, else the model's
        ``max_position_embeddings`` (a vision model's language config's), else 4096.
        ``model_config``: a transformers config or config.json as a dict."""
        text = _config_field(model_config, "text_config") or model_config
        return int(self.context_length or _config_field(model_config, "max_position_embeddings")
                   or _config_field(text, "max_position_embeddings") or 4096)

    def served_dtype_name(self, model_config: object) -> str:
        """The dtype the weights are loaded in: ``--dtype``; ``auto`` is the checkpoint's own
        (``dtype`` or ``torch_dtype`` in its config), float32 when it names none."""
        if self.dtype != "auto":
            return self.dtype
        named = _config_field(model_config, "dtype") or _config_field(model_config, "torch_dtype") or "float32"
        return str(named).removeprefix("torch.")

    def limits(self) -> Limits:
        """The per-request caps these flags set."""
        origins = frozenset(normalize_origin(o) for o in self.allowed_origins.split(",") if o.strip())
        return Limits(max_body_bytes=self.max_body_bytes, max_prompts=self.max_prompts,
                      max_request_tokens=self.max_request_tokens, idle_timeout_s=self.idle_timeout_s,
                      body_timeout_s=self.body_timeout_s, allowed_origins=origins)

    def __repr__(self) -> str:  # never print the api key
        fields = {k: v for k, v in self.__dict__.items() if k != "api_key"}
        fields["api_key"] = "***" if self.api_key else None
        return "ServerArgs(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"


DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("fp8",)


def _config_field(model_config: object, name: str) -> object:
    """``name`` of a transformers config object or of a config.json dict (None when absent)."""
    if isinstance(model_config, dict):
        return model_config.get(name)
    return getattr(model_config, name, None)


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``python -m arealite.server``."""
    p = argparse.ArgumentParser(
        prog="python -m arealite.server",
        description="arealite's embedded SGLang-compatible inference server (Hugging Face model in PyTorch).",
    )
    p.add_argument("--model-path", required=True, help="Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="fp8: linear weights stored as block-wise float8_e4m3fn + weight_scale_inv, "
                        "quantised on load and on every weight update")
    p.add_argument("--random-seed", type=int, default=0)
    # Launchers pass the key in the environment: a command line shows in `ps`. --api-key
    # stays for SGLang's flag set, and is warned about.
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health*; visible to every "
                        f"user in the process list: prefer ${ENV_API_KEY} or --api-key-file")
    p.add_argument("--api-key-file", default=None,
                   help="read the API key from this file (first line; keep it readable by you alone)")
    p.add_argument("--max-batch-size", "--max-running-requests", dest="max_batch_size", type=int, default=64)
    p.add_argument("--prompt-cache-entries", type=int, default=64,
                   help="prompts whose KV cache is kept for later admissions of the same prompt (0: none; "
                        "cleared on every weight update)")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="record the experts an MoE model routes each token to (requests ask with "
                        "return_routed_experts; meta_info.routed_experts)")
    p.add_argument("--weight-version", default="0")
    p.add_argument("--weight-sync-timeout-s", type=float, default=600.0)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--strict-sglang", action="store_true",
                   default=os.environ.get("AREALITE_STRICT_SGLANG", "").lower() in ("1", "true", "yes"),
                   help="behave as SGLang where it is unforgiving: /health generates (and waits while "
                        "paused), read-back only for SGLang's model classes")
    p.add_argument("--sglang-version", default="0.5.23",
                   help="SGLang release to report and emulate (before 0.5.21: no begin/end_weight_update)")
    p.add_argument("--no-freeze-gc", dest="freeze_gc", action="store_false",
                   help="let the garbage collector keep scanning the model and libraries loaded at start "
                        "(by default they are frozen once: full scans of them stall generation ~0.2 s)")
    p.add_argument("--skip-server-warmup", action="store_true",
                   help="strict mode: no start-up warm-up (SGLang's flag); the server is ready at once")
    p.add_argument("--warmup-delay-s", type=float, default=0.0,
                   help="strict mode: wait this long before the start-up warm-up's /generate (a slow warm-up; "
                        "its timeout is $SGLANG_WARMUP_TIMEOUT, after which the server exits as SGLang does)")
    p.add_argument("--enable-memory-saver", action="store_true",
                   help="SGLang's flag: allow /release_memory_occupation (required under --strict-sglang)")
    p.add_argument("--enable-weights-cpu-backup", action="store_true",
                   help="SGLang's flag: released weights keep their contents in host memory")
    p.add_argument("--readback-architectures", default=None,
                   help="comma-separated model classes whose weights can be read back ('all')")
    g = p.add_argument_group("request limits (docs/security.md)")
    g.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes,
                   help="largest request body; a bigger Content-Length is refused unread (413)")
    g.add_argument("--max-prompts", type=int, default=Limits.max_prompts, help="most prompts in one /generate batch")
    g.add_argument("--max-request-tokens", type=int, default=Limits.max_request_tokens,
                   help="most prompt + max_new_tokens tokens, summed, in one /generate request")
    g.add_argument("--idle-timeout-s", type=float, default=Limits.idle_timeout_s,
                   help="close a connection that sends no complete request head for this long")
    g.add_argument("--body-timeout-s", type=float, default=Limits.body_timeout_s,
                   help="longest wait for a request body once its head arrived (408 after)")
    g.add_argument("--allowed-origins", default="",
                   help="comma-separated browser origins allowed to call the server (default: none)")
    g.add_argument("--max-image-bytes", type=int, default=32 << 20,
                   help="vision models: largest base64-decoded image in image_data (bytes; 400 above)")
    g.add_argument("--max-image-pixels", type=int, default=4096 * 4096,
                   help="vision models: most pixels (width x height) of one image in image_data (400 above)")
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """Parse and check the command line; a bad value exits with a message naming the flag."""
    p = build_parser()
    ns = p.parse_args(argv)
    if not 1 <= ns.port <= 65535:
        p.error(f"--port {ns.port} is not a TCP port (1..65535)")
    if ns.max_batch_size < 1:
        p.error(f"--max-batch-size {ns.max_batch_size} must be at least 1")
    if ns.prompt_cache_entries < 0:
        p.error(f"--prompt-cache-entries {ns.prompt_cache_entries} must be at least 0 (0 turns the cache off)")
    if ns.context_length is not None and ns.context_length < 2:
        p.error(f"--context-length {ns.context_length} must be at least 2")
    if not ns.sglang_version[:1].isdigit():
        p.error(f"--sglang-version {ns.sglang_version!r} is not a release such as 0.5.23")
    if not ns.warmup_delay_s >= 0:
        p.error(f"--warmup-delay-s {ns.warmup_delay_s} must be >= 0")
    if ns.weight_sync_timeout_s <= 0:
        p.error("--weight-sync-timeout-s must be positive")
    for flag in ("max_body_bytes", "max_prompts", "max_request_tokens", "max_image_bytes", "max_image_pixels"):
        if getattr(ns, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(ns, flag)} must be at least 1")
    for flag in ("idle_timeout_s", "body_timeout_s"):
        if not getattr(ns, flag) > 0:
            p.error(f"--{flag.replace('_', '-')} {getattr(ns, flag)} must be positive")
    ns.api_key_on_argv = ns.api_key is not None
    ns.api_key = ns.api_key or _key_from_file(p, ns.api_key_file) or os.environ.get(ENV_API_KEY) or None
    return ServerArgs(**vars(ns))


def _key_from_file(p: argparse.ArgumentParser, path: str | None) -> str | None:
    """The first line of the key file (None without one); an unreadable or empty file is an error."""
    if path is None:
        return None
    try:
        key = Path(path).read_text(encoding="utf-8").splitlines()[0].strip() if Path(path).is_file() else ""
    except (OSError, UnicodeDecodeError, IndexError) as e:
        p.error(f"--api-key-file {path!r} cannot be read: {e}")
    if not key:
        p.error(f"--api-key-file {path!r} is not a regular file holding a key on its first line")
    return key
