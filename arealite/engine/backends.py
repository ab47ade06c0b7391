"""Which client speaks to which servers: one entry per ``launch.server_backend`` value.

A backend is one module that joins the client core (`remote_client.py`) with the
backend's wire format and administration (as `sglang_remote.py` does for SGLang);
adding one (vLLM, say) is that module, one line in ``_ENGINES`` and the config value.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence

from arealite.config.schema import RolloutConfig
from arealite.engine.remote_client import RemoteInferenceClient

__all__ = ["make_remote_engine", "remote_engine_class"]

#: ``launch.server_backend`` -> "module:class" of its engine (imported on first use).
_ENGINES = {
    "sglang": "arealite.engine.sglang_remote:RemoteSGLangEngine",
    "embedded": "arealite.engine.sglang_remote:RemoteSGLangEngine",  # it speaks SGLang's protocol
}


def remote_engine_class(backend: str) -> type[RemoteInferenceClient]:
    """The engine class of a ``launch.server_backend`` value."""
    if backend not in _ENGINES:
        raise ValueError(f"launch.server_backend={backend!r}: no inference client for it "
                         f"(known: {', '.join(sorted(_ENGINES))})")
    module, _, name = _ENGINES[backend].partition(":")
    return getattr(importlib.import_module(module), name)


def make_remote_engine(backend: str, addrs: Sequence[str] | str, config: RolloutConfig | None = None,
                       api_key: str | None = None, *,
                       eos_token_ids: Iterable[int] = (), vocab_size: int | None = None,
                       lora_adapter: str | None = None) -> RemoteInferenceClient:
    """The client of `backend`'s servers; its ``admin`` is their ``WeightUpdateAdmin``.
    ``vocab_size``: output ids at or above it are refused as malformed answers;
    ``lora_adapter``: the LoRA adapter every request names (None: the base model)."""
    return remote_engine_class(backend)(addrs, config, api_key, eos_token_ids=eos_token_ids,
                                        vocab_size=vocab_size, lora_adapter=lora_adapter)
