"""Command-line arguments of the embedded server (a subset of SGLang's flags)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


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
    random_seed: int = 0
    """Seeds the shared sampling generator (requests without ``sampling_seed``)."""
    api_key: str | None = None
    """When set, every route except the ``/health*`` probes needs ``Authorization: Bearer <key>``."""
    max_batch_size: int = 64
    """Most sequences decoded together; further requests queue."""
    context_length: int | None = None
    """Longest prompt + completion; defaults to the model's ``max_position_embeddings``."""
    device: str = "auto"
    """``auto`` (CUDA when present, else CPU), ``cpu`` or ``cuda``."""
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
    readback_architectures: str | None = None
    """Model classes whose weights ``/get_weights_by_name`` reads back, comma-separated
    (``all``); default: every class, or SGLang's list under ``--strict-sglang``."""

    def __repr__(self) -> str:  # never print the api key
        fields = {k: v for k, v in self.__dict__.items() if k != "api_key"}
        fields["api_key"] = "***" if self.api_key else None
        return "ServerArgs(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"


DTYPES = ("auto", "float32", "bfloat16", "float16")


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
    p.add_argument("--random-seed", type=int, default=0)
    # Launchers pass the key in the environment: a command line shows in `ps`.
    p.add_argument("--api-key", default=os.environ.get("AREALITE_SERVER_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every route but /health* "
                        "(default: $AREALITE_SERVER_API_KEY)")
    p.add_argument("--max-batch-size", "--max-running-requests", dest="max_batch_size", type=int, default=64)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--weight-version", default="0")
    p.add_argument("--weight-sync-timeout-s", type=float, default=600.0)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--strict-sglang", action="store_true",
                   default=os.environ.get("AREALITE_STRICT_SGLANG", "").lower() in ("1", "true", "yes"),
                   help="behave as SGLang where it is unforgiving: /health generates (and waits while "
                        "paused), read-back only for SGLang's model classes")
    p.add_argument("--sglang-version", default="0.5.23",
                   help="SGLang release to report and emulate (before 0.5.21: no begin/end_weight_update)")
    p.add_argument("--readback-architectures", default=None,
                   help="comma-separated model classes whose weights can be read back ('all')")
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """Parse and check the command line; a bad value exits with a message naming the flag."""
    p = build_parser()
    ns = p.parse_args(argv)
    if not 1 <= ns.port <= 65535:
        p.error(f"--port {ns.port} is not a TCP port (1..65535)")
    if ns.max_batch_size < 1:
        p.error(f"--max-batch-size {ns.max_batch_size} must be at least 1")
    if ns.context_length is not None and ns.context_length < 2:
        p.error(f"--context-length {ns.context_length} must be at least 2")
    if not ns.sglang_version[:1].isdigit():
        p.error(f"--sglang-version {ns.sglang_version!r} is not a release such as 0.5.23")
    if ns.weight_sync_timeout_s <= 0:
        p.error("--weight-sync-timeout-s must be positive")
    return ServerArgs(**vars(ns))
