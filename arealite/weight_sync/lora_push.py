"""Weight push of a LoRA run: only the adapter travels, as a PEFT directory reloaded by name.

Per version ``v`` (the publisher's sequence, `publisher.WeightPublisher`):

- ``stage`` (servers still generating; every trainer rank reads the adapter, a collective):
  rank 0 writes ``adapter_config.json`` and ``adapter_model.safetensors`` (in the servers'
  dtype) to ``<root>/<name>-v<v>-<id>``;
- ``transfer`` (servers paused): ``/unload_lora_adapter {lora_name: name}`` (a server that
  does not hold it yet is fine), ``/load_lora_adapter {lora_name: name, lora_path: dir}``,
  ``/update_weight_version`` so they report ``v``; the previous directory is deleted.

One name for every version (``actor.lora.served_name``): every client of the run, on every
trainer rank and in every rollout worker, sends ``lora_path: <name>`` from the config alone,
so nothing has to tell them a new name. This is safe because of how SGLang orders a
request (``TokenizerManager.generate_request``): it waits while generation is paused
*before* it resolves ``lora_path``, so requests that arrive during the push (the ones the
pause aborted, resubmitted) take the new adapter after ``continue_generation``; the pause's
abort releases every running request's hold on the old adapter, which lets the unload
finish. A fresh name per version would not work: SGLang remembers every name it ever loaded
and quietly reloads an unloaded one from its old path when a request names it.

The servers need ``--enable-lora``, ``--max-lora-rank`` and ``--lora-target-modules`` (the
launcher passes them, see `arealite.server.command_line`). The directory must be on a
filesystem the servers see (``weight_sync.disk_dir``).
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import TypeVar

import torch

from arealite.api.contracts import Runner, WeightUpdateAdmin, require
from arealite.lora.engine import LoraFSDPEngine
from arealite.lora.files import write_adapter_dir
from arealite.utils.json_types import JsonObject
from arealite.weight_sync.base import Timer, bucket_bytes_of, call_dropping_dead, logger

T = TypeVar("T")

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
    """Pushes a LoRA adapter, reloaded under the same name at every version (see the module's docstring).

    ``adapter_config`` is the adapter's ``adapter_config.json``; ``name`` the name the servers
    serve it under (every request's ``lora_path``)."""

    def __init__(self, config, admin: WeightUpdateAdmin, run: Runner, root: str | Path,
                 adapter_config: JsonObject, *, server_dtype: torch.dtype | None = None,
                 name: str = "policy"):
        require(admin, WeightUpdateAdmin, "the servers' admin of a LoRA weight push")
        for route in ("load_lora_adapter", "unload_lora_adapter", "update_weight_version"):
            if not callable(getattr(admin, route, None)):
                raise TypeError(f"the servers' admin {type(admin).__name__} has no {route}(): it cannot push LoRA")
        self.config, self.admin, self.run = config, admin, run
        self.root = Path(root)
        self.adapter_config = adapter_config
        self.server_dtype = server_dtype
        self.name = name
        self.current: Path | None = None  # the directory of the adapter the servers serve
        self._staged: Path | None = None
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
        path = self.root / f"{self.name}-v{version}-{uuid.uuid4().hex[:6]}"
        self._staged = path
        tensors = (t for bucket in source.named_weight_buckets(self.bucket_bytes) for t in bucket)
        try:
            self._counts = write_adapter_dir(path, tensors, self.adapter_config, dtype=self.server_dtype)
        except BaseException:
            self._discard_staged()
            raise
        timer.lap("write_s")
        return timer.timings

    def transfer(self, source, version: int) -> dict[str, float]:
        """On every (paused) server: unload the adapter, load the staged one under the same
        name, tag the version; then delete the previous directory."""
        if self._staged is None:
            raise RuntimeError("LoraTransfer.transfer without stage(): the publisher calls stage first")
        timer = Timer()
        path, timeout = self._staged, self.config.timeout_s
        try:
            # A server that does not hold it (a fresh one; the first push of a run) is fine.
            self._call(lambda: self.admin.unload_lora_adapter(self.name, timeout=timeout, missing_ok=True),
                       version, "unload_lora_adapter")
            timer.lap("unload_s")
            self._call(lambda: self.admin.load_lora_adapter(self.name, str(path.resolve()), timeout=timeout),
                       version, "load_lora_adapter")
        except BaseException:
            self._discard_staged()
            raise
        self._staged = None
        old, self.current = self.current, path
        timer.lap("load_s")
        self._call(lambda: self.admin.update_weight_version(version), version, "update_weight_version")
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        n_tensors, n_bytes = self._counts
        logger.info("version %d: LoRA adapter %s loaded from %s (%d tensors, %.2f MB)", version, self.name,
                    path.name, n_tensors, n_bytes / 2**20)
        return dict(timer.timings, bytes=float(n_bytes), n_tensors=float(n_tensors))

    def _call(self, make_coro: Callable[[], Coroutine[object, object, T]], version: int, what: str) -> T:
        return call_dropping_dead(self.run, self.admin, make_coro, version, what)

    def _discard_staged(self) -> None:
        if self._staged is not None:
            shutil.rmtree(self._staged, ignore_errors=True)
            self._staged = None

    def close(self) -> None:
        """Delete the adapter directories (the servers keep the adapter they loaded)."""
        self._discard_staged()
        if self.current is not None:
            shutil.rmtree(self.current, ignore_errors=True)
        try:
            self.root.rmdir()
        except OSError:
            pass
