"""Weight transfer through a shared directory: rank 0 writes safetensors, servers load them.

Used on trainer rank 0 (the publisher keeps the other ranks reading the source in
step). ``stage`` (servers still generating) writes each bucket of
``engine.named_weight_buckets`` as one shard of an HF safetensors directory (plus the
index and ``config.json``). ``transfer`` (servers paused by the publisher) posts
``/update_weights_from_disk {model_path, weight_version}`` and deletes the directory.
The servers must see the same filesystem (one machine, or a shared mount via
`weight_sync.disk_dir`).
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import torch

from arealite.api.contracts import Runner, WeightSource, WeightUpdateAdmin, require
from arealite.weight_sync.base import (
    Timer,
    WeightSyncError,
    bucket_bytes_of,
    call_dropping_dead,
    logger,
)

#: Files copied from the model directory next to the weights (servers may read the config).
_CONFIG_FILES = ("config.json", "generation_config.json")


def write_hf_shards(source: WeightSource, out_dir: Path, bucket_bytes: int,
                    model_path: str | None = None) -> tuple[int, int]:
    """Write `source`'s weights as sharded safetensors under `out_dir`; return (tensors, bytes)."""
    from safetensors.torch import save_file

    n_tensors = n_bytes = 0
    weight_map: dict[str, str] = {}
    out_dir.mkdir(parents=True, exist_ok=False)
    for i, bucket in enumerate(source.named_weight_buckets(bucket_bytes)):
        fname = f"model-{i + 1:05d}.safetensors"
        tensors = {}
        for name, t in bucket:
            if name in weight_map or name in tensors:
                raise WeightSyncError(f"the train engine yields tensor {name!r} twice", tensor=name)
            t = t.detach().to("cpu").contiguous()
            tensors[name] = t
            n_tensors += 1
            n_bytes += t.numel() * t.element_size()
        save_file(tensors, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    index = {"metadata": {"total_size": n_bytes}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    if model_path:
        for f in _CONFIG_FILES:
            if (Path(model_path) / f).is_file():
                shutil.copy2(Path(model_path) / f, out_dir / f)
    return n_tensors, n_bytes


class DiskTransfer:
    """Moves weights through an HF safetensors directory under `root` (deleted after each update).

    `model_path` is the trained model's directory (its ``config.json`` is copied
    next to the weights). `run(coro)` runs `admin` coroutines on the client's loop.
    `server_dtype` is the servers' weight dtype (for the read-back tolerance).
    """

    def __init__(self, config, admin: WeightUpdateAdmin, run: Runner, root: str | Path,
                 model_path: str | None = None, *, server_dtype: torch.dtype | None = None):
        require(admin, WeightUpdateAdmin, "the servers' admin of weight_sync.method=disk")
        self.config = config
        self.admin = admin
        self.run = run
        self.root = Path(root)
        self.model_path = model_path
        self.server_dtype = server_dtype
        self._staged: Path | None = None
        self._counts = (0, 0)

    @property
    def bucket_bytes(self) -> int:
        return bucket_bytes_of(self.config)

    def init(self, master_addr: str | None = None) -> None:
        """Nothing to set up but the scratch directory (same signature as the distributed transfer)."""
        self.root.mkdir(parents=True, exist_ok=True)

    def stage(self, source: WeightSource, version: int) -> dict[str, float]:
        """Write the weights as a new directory (the servers still generate)."""
        self._discard()
        timer = Timer()
        path = self.root / f"v{version}-{uuid.uuid4().hex[:6]}"
        self._staged = path
        try:
            self._counts = write_hf_shards(source, path, self.bucket_bytes, model_path=self.model_path)
        except BaseException:
            self._discard()
            raise
        timer.lap("write_s")
        return timer.timings

    def transfer(self, source: WeightSource, version: int) -> dict[str, float]:
        """Load the staged directory on every server (paused), then delete it."""
        if self._staged is None:
            raise RuntimeError("DiskTransfer.transfer without stage(): the publisher calls stage first")
        timer = Timer()
        path = self._staged
        try:
            call_dropping_dead(self.run, self.admin, lambda: self.admin.update_weights_from_disk(
                str(path.resolve()), version, timeout=self.config.timeout_s), version,
                "update_weights_from_disk")
        finally:
            self._discard()
        timer.lap("load_s")
        n_tensors, n_bytes = self._counts
        out = dict(timer.timings, bytes=float(n_bytes), n_tensors=float(n_tensors))
        logger.info("version %d loaded from disk: %d tensors, %.1f MB", version, n_tensors, n_bytes / 2**20)
        return out

    def _discard(self) -> None:
        if self._staged is not None:
            shutil.rmtree(self._staged, ignore_errors=True)
            self._staged = None

    def close(self) -> None:
        """Remove what is left in the scratch directory, and the directory if it is empty."""
        self._discard()
        try:
            self.root.rmdir()
        except OSError:
            pass
