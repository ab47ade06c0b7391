"""Weight push of a LoRA run: only the adapter travels, as a PEFT directory loaded by name.

Per version ``v`` (the publisher's sequence, `publisher.WeightPublisher`):

- ``stage`` (servers still generating; every trainer rank reads the adapter, a collective):
  rank 0 writes ``adapter_config.json`` and ``adapter_model.safetensors`` (in the servers'
  dtype) to ``<root>/policy-v<v>-<id>``, the adapter's name;
- ``transfer`` (servers paused): ``/load_lora_adapter {lora_name, lora_path}`` on every
  server, ``/update_weight_version`` so they report ``v``, then the previous adapter is
  unloaded and its directory deleted; from then on every request the client sends, the
  interrupted ones it resumes after ``continue_generation`` included, carries
  ``lora_path: <name>`` (`on_loaded` sets it on the client's wire and the probe's admin).

A fresh name per version means an interrupted request never mixes adapters within a
segment, and a push that is retried never collides with a name already loaded. Two
adapters are loaded at most, and only during the push (SGLang: ``--max-loras-per-batch``
counts the base model too; the launcher passes ``--enable-lora``, ``--max-lora-rank`` and
``--lora-target-modules``, see `arealite.launcher.server_cmd`). The directory must be on a
filesystem the servers see (``weight_sync.disk_dir``).
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Iterator

import torch

from arealite.api.engine import Runner, WeightUpdateAdmin, require
from arealite.lora.engine import LoraFSDPEngine
from arealite.lora.files import write_adapter_dir
from arealite.weight_sync.base import Timer, bucket_bytes_of, call_dropping_dead, logger

__all__ = ["AdapterSource", "LoraTransfer"]


class AdapterSource:
    """The `WeightSource` of a LoRA push: the engine's adapter tensors (PEFT names)."""

    def __init__(self, engine: "LoraFSDPEngine"):
        if not callable(getattr(engine, "adapter_buckets", None)):
            raise TypeError(f"{type(engine).__name__} has no adapter_buckets(): actor.lora needs a LoRA engine")
        self.engine = engine

    def named_weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        return self.engine.adapter_buckets(bucket_bytes)


class LoraTransfer:
    """Pushes a LoRA adapter under a new name per version (see the module's docstring).

    ``adapter_config`` is the adapter's ``adapter_config.json``; ``on_loaded(name)`` is called
    once every server holds the new adapter (it points the client's requests at it)."""

    def __init__(self, config, admin: WeightUpdateAdmin, run: Runner, root: str | Path,
                 adapter_config: dict[str, Any], *, server_dtype: torch.dtype | None = None,
                 on_loaded: Callable[[str], None] = lambda name: None, prefix: str = "policy"):
        require(admin, WeightUpdateAdmin, "the servers' admin of a LoRA weight push")
        for route in ("load_lora_adapter", "unload_lora_adapter", "update_weight_version"):
            if not callable(getattr(admin, route, None)):
                raise TypeError(f"the servers' admin {type(admin).__name__} has no {route}(): it cannot push LoRA")
        self.config, self.admin, self.run = config, admin, run
        self.root = Path(root)
        self.adapter_config = adapter_config
        self.server_dtype = server_dtype
        self.on_loaded, self.prefix = on_loaded, prefix
        self.current: tuple[str, Path] | None = None  # the adapter the servers serve
        self._staged: tuple[str, Path] | None = None
        self._counts = (0, 0)

    @property
    def bucket_bytes(self) -> int:
        return bucket_bytes_of(self.config)

    def init(self, master_addr: str | None = None) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def stage(self, source, version: int) -> dict[str, float]:
        """Write the adapter directory (the servers still generate)."""
        self._discard_staged()
        timer = Timer()
        name = f"{self.prefix}-v{version}-{uuid.uuid4().hex[:6]}"
        path = self.root / name
        self._staged = (name, path)
        tensors = (t for bucket in source.named_weight_buckets(self.bucket_bytes) for t in bucket)
        try:
            self._counts = write_adapter_dir(path, tensors, self.adapter_config, dtype=self.server_dtype)
        except BaseException:
            self._discard_staged()
            raise
        timer.lap("write_s")
        return timer.timings

    def transfer(self, source, version: int) -> dict[str, float]:
        """Load the staged adapter on every (paused) server, tag the version, unload the old one."""
        if self._staged is None:
            raise RuntimeError("LoraTransfer.transfer without stage(): the publisher calls stage first")
        timer = Timer()
        name, path = self._staged
        timeout = self.config.timeout_s
        try:
            self._call(lambda: self.admin.load_lora_adapter(name, str(path.resolve()), timeout=timeout),
                       version, "load_lora_adapter")
        except BaseException:
            self._discard_staged()
            raise
        self._staged = None
        old, self.current = self.current, (name, path)
        self.on_loaded(name)
        timer.lap("load_s")
        self._call(lambda: self.admin.update_weight_version(version), version, "update_weight_version")
        if old is not None:
            self._call(lambda: self.admin.unload_lora_adapter(old[0], timeout=timeout), version,
                       "unload_lora_adapter")
            shutil.rmtree(old[1], ignore_errors=True)
        timer.lap("unload_s")
        n_tensors, n_bytes = self._counts
        logger.info("version %d: LoRA adapter %s loaded (%d tensors, %.2f MB)", version, name, n_tensors,
                    n_bytes / 2**20)
        return dict(timer.timings, bytes=float(n_bytes), n_tensors=float(n_tensors))

    def _call(self, make_coro, version: int, what: str) -> Any:
        return call_dropping_dead(self.run, self.admin, make_coro, version, what)

    def _discard_staged(self) -> None:
        if self._staged is not None:
            shutil.rmtree(self._staged[1], ignore_errors=True)
            self._staged = None

    def close(self) -> None:
        """Delete the adapter directories (the servers keep the adapter they loaded)."""
        self._discard_staged()
        if self.current is not None:
            shutil.rmtree(self.current[1], ignore_errors=True)
        try:
            self.root.rmdir()
        except OSError:
            pass
