"""``SGLangClient``: the inference client for SGLang (and the embedded server).

It joins the three pieces of a backend over one `ServerPool`:

- the client core, `remote_client.RemoteInferenceClient` (generation, routing,
  retries, resubmission after aborts, server health), which it is;
- SGLang's wire format, `sglang_wire.SGLangWire`;
- SGLang's administration, `sglang_admin.SGLangAdmin`, as ``engine.admin`` (the
  ``WeightUpdateAdmin`` a weight publisher uses). Its routes are also methods of the
  engine (``await engine.pause_generation()`` ...), for scripts and tests; called this
  way, an update that tags the servers with a version also sets the client's (through
  ``engine.admin`` the weight publisher sets it, once the update is verified).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Iterable, Sequence
from typing import Callable

from arealite.config.schema import RolloutConfig
from arealite.inference_client.errors import (
    BadRequestError,
    GenerationError,
    NoHealthyServerError,
    ServerAdminError,
    ServerStartupError,
)
from arealite.inference_client.remote_client import RemoteInferenceClient
from arealite.inference_client.sglang_admin import SGLangAdmin
from arealite.inference_client.sglang_wire import WEIGHT_UPDATE_BRACKETS_SINCE, SGLangWire, parse_sglang_version
from arealite.inference_client.wire import dumps as _dumps  # noqa: F401  (benchmarks import these from here)
from arealite.inference_client.wire import loads as _loads  # noqa: F401

__all__ = [
    "SGLangClient",
    "GenerationError",
    "BadRequestError",
    "NoHealthyServerError",
    "ServerAdminError",
    "ServerStartupError",
    "parse_sglang_version",
    "WEIGHT_UPDATE_BRACKETS_SINCE",
]


def _to_admin(name: str, *, tags_version: bool = False) -> Callable[..., object]:
    """A method of the engine that calls ``self.admin.<name>`` (same signature and doc).

    With ``tags_version``, the call's ``version`` becomes the client's once it succeeded.
    """
    target = getattr(SGLangAdmin, name)
    if tags_version:
        sig = inspect.signature(target)

        async def method(self, *args, **kwargs):
            out = await getattr(self.admin, name)(*args, **kwargs)
            version = sig.bind(self.admin, *args, **kwargs).arguments.get("version")
            if version is not None:
                self.set_version(int(version))
            return out
    elif asyncio.iscoroutinefunction(target):
        async def method(self, *args, **kwargs):
            return await getattr(self.admin, name)(*args, **kwargs)
    else:
        def method(self, *args, **kwargs):
            return getattr(self.admin, name)(*args, **kwargs)
    functools.update_wrapper(method, target)
    method.__qualname__ = f"SGLangClient.{name}"
    return method


class SGLangClient(RemoteInferenceClient):
    """Generation and administration of SGLang-compatible servers over HTTP.

    ``addrs`` are "host:port" (or "http://host:port"). ``api_key`` is sent as
    ``Authorization: Bearer <key>`` on every request and never logged.
    ``eos_token_ids`` (optional) are treated as stop tokens when an aborted
    segment ends on one; output ids must lie below ``vocab_size`` when it is given. A server leaves the rotation after
    ``unhealthy_after`` consecutive failures and is probed every
    ``health_probe_interval_s`` seconds to come back. Requests held by
    ``pause_generation`` fail once the pause has lasted ``max_pause_s`` seconds
    without ``continue_generation`` (a weight update that died half-way).
    """

    def __init__(self, addrs: Sequence[str] | str, config: RolloutConfig | None = None,
                 api_key: str | None = None, *, eos_token_ids: Iterable[int] = (),
                 unhealthy_after: int = 3, health_probe_interval_s: float = 5.0,
                 max_pause_s: float = 3600.0, vocab_size: int | None = None, lora_adapter: str | None = None,
                 return_routed_experts: bool = False, pause_mode: str = "abort"):
        super().__init__(addrs, config, api_key, wire=SGLangWire(), eos_token_ids=eos_token_ids,
                         unhealthy_after=unhealthy_after, health_probe_interval_s=health_probe_interval_s,
                         max_pause_s=max_pause_s, vocab_size=vocab_size)
        self.admin = SGLangAdmin(self.pool, pause_mode)
        # A LoRA run: every request and the log-prob probe run with the adapter served under
        # this name (`arealite.weight_sync.lora_push` reloads it under the same name each push).
        self.wire.lora_path = self.admin.lora_path = lora_adapter
        # MoE routing replay (algorithm.routing_replay: r3): every request asks for its routing.
        self.wire.return_routed_experts = return_routed_experts

    async def __aenter__(self) -> "SGLangClient":
        return await super().__aenter__()

    pause_generation = _to_admin("pause_generation")
    continue_generation = _to_admin("continue_generation")
    flush_cache = _to_admin("flush_cache")
    update_weights_from_disk = _to_admin("update_weights_from_disk", tags_version=True)
    update_weights_from_shm = _to_admin("update_weights_from_shm", tags_version=True)
    get_weights_by_name = _to_admin("get_weights_by_name")
    update_weight_version = _to_admin("update_weight_version", tags_version=True)
    begin_weight_update = _to_admin("begin_weight_update")
    end_weight_update = _to_admin("end_weight_update")
    supports_weight_update_brackets = _to_admin("supports_weight_update_brackets")
    weights_update_world_size = _to_admin("weights_update_world_size")
    group_members = _to_admin("group_members")
    init_weights_update_group = _to_admin("init_weights_update_group")
    update_weights_from_distributed = _to_admin("update_weights_from_distributed", tags_version=True)
    destroy_weights_update_group = _to_admin("destroy_weights_update_group")
