"""Which client speaks to which servers: one entry per ``launch.server_backend`` value.

A backend is one module that joins the client core (`remote_client.py`) with the
backend's wire format and administration (as `sglang_client.py` does for SGLang);
adding one (vLLM, say) is that module, one line in ``_CLIENTS`` and the config value.
"""

from __future__ import annotations

import importlib

from arealite.inference_client.remote_client import RemoteInferenceClient

__all__ = ["client_class"]

#: ``launch.server_backend`` -> "module:class" of its inference client (imported on first use).
_CLIENTS = {
    "sglang": "arealite.inference_client.sglang_client:SGLangClient",
    "embedded": "arealite.inference_client.sglang_client:SGLangClient",  # it speaks SGLang's protocol
    "sim": "arealite.inference_client.sglang_client:SGLangClient",  # the embedded server's app, simulated
}


def client_class(backend: str) -> type[RemoteInferenceClient]:
    """The inference client class of a ``launch.server_backend`` value; built with
    ``(addrs, config, api_key, eos_token_ids=..., vocab_size=..., lora_adapter=...)``, its
    ``admin`` is the servers' ``WeightUpdateAdmin``."""
    if backend not in _CLIENTS:
        raise ValueError(f"launch.server_backend={backend!r}: no inference client for it "
                         f"(known: {', '.join(sorted(_CLIENTS))})")
    module, _, name = _CLIENTS[backend].partition(":")
    return getattr(importlib.import_module(module), name)

