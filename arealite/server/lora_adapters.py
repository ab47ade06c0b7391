"""LoRA adapters on the embedded server, with SGLang's routes and request field.

- ``POST /load_lora_adapter {lora_name, lora_path, pinned?}``: read a PEFT adapter directory
  (``adapter_config.json``, ``adapter_model.safetensors``) and register it under ``lora_name``;
  a name already loaded is refused, as SGLang does.
- ``POST /unload_lora_adapter {lora_name}``: forget it. Sequences running with it finish on it
  (each holds its adapter), as SGLang's unload waits for the requests using it.
- ``/generate`` with ``lora_path`` (a name, a list of names per prompt, or null for the base
  model) selects the adapter; an unknown name is a 400. As in SGLang's tokenizer manager, a
  request that arrives while generation is paused looks its adapter up only once the pause
  is over (so a push may unload and reload a name under a pause; ``EmbeddedServer.generate``).

Both answer SGLang's ``LoRAUpdateOutput``: ``{success, error_message, loaded_adapters}``.

Application: a forward hook on every targeted linear module adds
``(x @ A.T) @ B.T * scaling`` to the rows of the batch whose sequence uses the adapter, as
PEFT's ``lora.Linear`` computes it, so log-probs equal the trainer's forward. The model's
state dict is untouched, so the full-weight routes keep working.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable

import torch
from aiohttp import web

from arealite.lora.files import read_adapter_dir
from arealite.utils.json_types import JsonObject

from .body import RequestError, check_fields, json_body, want
from .files import MAX_JSON_BYTES, UnsafeFile, check_regular
from .limits import short

if TYPE_CHECKING:
    from .runner_contract import GenerationRunner

logger = logging.getLogger("arealite.server")

_PREFIX = "base_model.model."


@dataclass(frozen=True)
class Adapter:
    """One loaded adapter: ``{module path: (A [r, in], B [out, r])}`` and its scaling."""

    name: str
    path: str
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scaling: float
    rank: int


def parse_adapter(name: str, path: str, model: torch.nn.Module) -> Adapter:
    """Read and check a PEFT adapter against ``model``; ``ValueError`` names what does not fit."""
    config, tensors = read_adapter_dir(path)
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"{path}/adapter_config.json: r={r!r}, lora_alpha={alpha!r} are not a rank and an alpha")
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    modules = dict(model.named_modules())
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        stem, _, part = key.removeprefix(_PREFIX).rpartition(".lora_")
        if part not in ("A.weight", "B.weight"):
            raise ValueError(f"{path}: tensor {key!r} is not a LoRA A/B weight (lora_embedding, bias: unsupported)")
        pairs.setdefault(stem, {})[part[0]] = t
    weights = {}
    for stem, ab in pairs.items():
        mod = modules.get(stem)
        if not isinstance(mod, torch.nn.Linear):
            raise ValueError(f"{path}: {stem!r} is not a linear module of the served model")
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None:
            raise ValueError(f"{path}: {stem!r} lacks its lora_{'A' if a is None else 'B'} weight")
        if tuple(a.shape) != (r, mod.in_features) or tuple(b.shape) != (mod.out_features, r):
            raise ValueError(f"{path}: {stem}: A {tuple(a.shape)}, B {tuple(b.shape)} do not fit a rank-{r} "
                             f"adapter of a {mod.in_features}->{mod.out_features} layer")
        weights[stem] = (a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous())
    if not weights:
        raise ValueError(f"{path}: the adapter has no LoRA weights")
    return Adapter(name=name, path=str(path), weights=weights, scaling=float(scaling), rank=r)


def _read_adapter(name: str, path: str, model: torch.nn.Module) -> Adapter:
    """`parse_adapter` after checking that the adapter's files are regular files (a FIFO or
    device named there would block or never end); every library error names the path."""
    from arealite.lora.files import CONFIG_FILE, WEIGHTS_FILE

    for file, cap in ((CONFIG_FILE, MAX_JSON_BYTES), (WEIGHTS_FILE, None)):
        full = os.path.join(path, file)
        if os.path.lexists(full):
            check_regular(full, "adapter file", cap)
    try:
        return parse_adapter(name, path, model)
    except ValueError:  # parse_adapter's own refusals (UnsafeFile among them) name the problem
        raise
    except Exception as e:  # SafetensorError, RecursionError, OSError...
        raise UnsafeFile(f"adapter {short(path, 300)} cannot be read: {type(e).__name__}: {short(str(e), 200)}") from None


class LoraSet:
    """The adapters a server holds and the hooks that apply them to the rows of a forward."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.adapters: dict[str, Adapter] = {}
        self._rows: list[Adapter | None] = []
        self._hooked: set[str] = set()
        self._lock = threading.Lock()

    def resolve(self, names: list[str | None]) -> list[Adapter | None]:
        """The adapter of each name (None = the base model); ``RequestError`` for an unknown one."""
        out = []
        for n in names:
            if n is None:
                out.append(None)
                continue
            a = self.adapters.get(n)
            if a is None:
                raise RequestError(f"lora_path: the following requested LoRA adapters are not loaded: {n} "
                                   f"(loaded: {sorted(self.adapters)})")
            out.append(a)
        return out

    def add(self, adapter: Adapter) -> None:
        with self._lock:
            if adapter.name in self.adapters:
                raise ValueError(f"Failed to load LoRA adapter {adapter.name} because it is already loaded")
            modules = dict(self.model.named_modules())
            for stem in adapter.weights.keys() - self._hooked:
                modules[stem].register_forward_hook(self._hook(stem))
                self._hooked.add(stem)
            self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        with self._lock:
            if self.adapters.pop(name, None) is None:
                # SGLang's words (LoRARegistry.unregister); clients recognise them.
                raise ValueError(f"LoRA with name {name} does not exist. Loaded LoRAs: {sorted(self.adapters)}")

    def select(self, rows: list[Adapter | None]) -> None:
        """The adapter of each batch row of the next forward (model thread)."""
        self._rows = rows

    def _hook(self, stem: str):
        def apply(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
            rows = self._rows
            if not any(rows):
                return output
            if len(rows) != output.shape[0]:
                raise RuntimeError(f"LoRA: {len(rows)} rows selected for a forward of {output.shape[0]}")
            x = inputs[0]
            for adapter in {id(a): a for a in rows if a is not None}.values():
                ab = adapter.weights.get(stem)
                if ab is None:
                    continue
                idx = torch.tensor([i for i, a in enumerate(rows) if a is adapter], device=output.device)
                a, b = ab
                output = output.index_add(0, idx, (x[idx] @ a.T) @ b.T * adapter.scaling)
            return output

        return apply

    def loaded(self) -> dict[str, str]:
        return {n: a.path for n, a in self.adapters.items()}


class LoraRoutes:
    """SGLang's LoRA routes on one served ``model``, whose forwards ``runner`` runs."""

    def __init__(self, model: torch.nn.Module, runner: GenerationRunner):
        self.model = model
        self.runner = runner
        self.lora = LoraSet(model)
        runner.lora = self.lora
        self._lock = asyncio.Lock()

    def routes(self) -> dict[str, Callable[[web.Request], Awaitable[web.Response]]]:
        return {"/load_lora_adapter": self.load, "/unload_lora_adapter": self.unload}

    def _answer(self, error: str | None) -> web.Response:
        return web.json_response({"success": error is None, "error_message": error,
                                  "loaded_adapters": self.lora.loaded()}, status=200 if error is None else 400)

    async def load(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        route = "load_lora_adapter"
        check_fields(body, {"lora_name", "lora_path"}, {"pinned", "lora_id"}, route)
        name, path = want(body, "lora_name", str, route), want(body, "lora_path", str, route)
        want(body, "pinned", bool, route, False)
        if not name or len(name) > 256 or not name.isprintable():
            raise RequestError(f"{route}: lora_name {short(name)} must be 1..256 printable characters")
        try:
            # Read without the lock: a slow or hostile path must not hold up other loads and unloads.
            adapter = await asyncio.to_thread(_read_adapter, name, path, self.model)
            async with self._lock:
                await self.runner.call(lambda: self.lora.add(adapter))
        except ValueError as e:
            logger.warning("%s(%s, %s) refused: %s", route, name, path, e)
            return self._answer(str(e))
        logger.info("LoRA adapter %s loaded from %s (rank %d, %d modules)", name, path, adapter.rank,
                    len(adapter.weights))
        return self._answer(None)

    async def unload(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        route = "unload_lora_adapter"
        check_fields(body, {"lora_name"}, {"lora_id"}, route)
        name = want(body, "lora_name", str, route)
        async with self._lock:
            try:
                await self.runner.call(lambda: self.lora.remove(name))
            except ValueError as e:
                return self._answer(str(e))
        return self._answer(None)

    def lora_names(self, body: JsonObject, n: int) -> list[str | None]:
        """The adapter names a ``/generate`` body asks for, one per prompt (None: the base)."""
        v = body.get("lora_path")
        if v is None:
            names: list[str | None] = [None] * n
        elif isinstance(v, str):
            names = [v] * n
        elif isinstance(v, list) and len(v) == n and all(x is None or isinstance(x, str) for x in v):
            names = v
        else:
            raise RequestError(f"lora_path must be an adapter name, null, or a list of {n} of them, got {str(v)[:80]}")
        return names
