"""Weight sync through a shared directory: rank 0 writes safetensors, servers load them.

Per update: every rank iterates ``engine.named_weight_buckets`` (collective),
rank 0 writes each bucket as one shard of an HF safetensors directory (plus the
index and ``config.json``), then pauses the servers, posts
``/update_weights_from_disk {model_path, weight_version}``, reads a sample of
tensors back, continues, and deletes the directory. The servers must see the
same filesystem (one machine, or a shared mount via `weight_sync.disk_dir`).
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import torch

from arealite.weight_sync.base import (
    VERIFY_TRUNCATE,
    ReadbackSample,
    Runner,
    Timer,
    WeightSource,
    WeightSyncError,
    call_dropping_dead,
    barrier,
    bucket_bytes_of,
    compare_readback,
    logger,
    trainer_rank,
)

#: Files copied from the model directory next to the weights (servers may read the config).
_CONFIG_FILES = ("config.json", "generation_config.json")


def write_hf_shards(source: WeightSource, out_dir: Path, bucket_bytes: int,
                    sample: ReadbackSample | None = None, model_path: str | None = None,
                    write: bool = True) -> tuple[int, int]:
    """Write `source`'s weights as sharded safetensors under `out_dir`; return (tensors, bytes).

    With ``write=False`` the buckets are only iterated (ranks other than 0).
    """
    from safetensors.torch import save_file

    n_tensors = n_bytes = 0
    weight_map: dict[str, str] = {}
    if write:
        out_dir.mkdir(parents=True, exist_ok=False)
    for i, bucket in enumerate(source.named_weight_buckets(bucket_bytes)):
        if not write:
            continue
        fname = f"model-{i + 1:05d}.safetensors"
        tensors = {}
        for name, t in bucket:
            if name in weight_map or name in tensors:
                raise WeightSyncError(f"the train engine yields tensor {name!r} twice", tensor=name)
            t = t.detach().to("cpu").contiguous()
            tensors[name] = t
            if sample is not None:
                sample.offer(name, t)
            n_tensors += 1
            n_bytes += t.numel() * t.element_size()
        save_file(tensors, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    if write:
        index = {"metadata": {"total_size": n_bytes}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        if model_path:
            for f in _CONFIG_FILES:
                if (Path(model_path) / f).is_file():
                    shutil.copy2(Path(model_path) / f, out_dir / f)
    return n_tensors, n_bytes


class DiskWeightSync:
    """Push weights through an HF safetensors directory under `root` (deleted after each update).

    `model_path` is the trained model's directory (its ``config.json`` is copied
    next to the weights). `run(coro)` runs client coroutines on the client's loop.
    """

    def __init__(self, config, client, run: Runner, root: str | Path,
                 model_path: str | None = None, *, server_dtype: torch.dtype | None = None):
        self.config = config
        self.client = client
        self.run = run
        self.root = Path(root)
        self.model_path = model_path
        self.server_dtype = server_dtype

    def init(self, master_addr: str | None = None) -> None:
        """Nothing to set up but the scratch directory (same signature as the distributed sync)."""
        rank, _ = trainer_rank()
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)

    def _admin(self, make_coro, version: int, what: str):
        # A server that is gone is dropped and the call repeated on the others.
        return call_dropping_dead(self.run, self.client, make_coro, version, what)

    def push(self, engine: WeightSource, version: int) -> dict[str, float]:
        """Write, load on every server, verify; returns timings (rank 0). Every rank calls it."""
        rank, _ = trainer_rank()
        bucket_bytes = bucket_bytes_of(self.config)
        if rank != 0:
            write_hf_shards(engine, self.root, bucket_bytes, write=False)
            barrier()
            return {}
        timer = Timer()
        sample = ReadbackSample(self.config.verify_n_tensors, version)
        path = self.root / f"v{version}-{uuid.uuid4().hex[:6]}"
        try:
            n_tensors, n_bytes = write_hf_shards(engine, path, bucket_bytes, sample,
                                                 self.model_path)
            timer.lap("write_s")
            self._admin(self.client.pause_generation, version, "pause_generation")
            timer.lap("pause_s")
            self._admin(lambda: self.client.update_weights_from_disk(
                str(path.resolve()), version, timeout=self.config.timeout_s), version,
                "update_weights_from_disk")
            timer.lap("load_s")
            answers = {name: self._admin(
                lambda n=name: self.client.get_weights_by_name(n, VERIFY_TRUNCATE), version,
                "get_weights_by_name") for name in sample.expected}
            compare_readback(sample.expected, answers, version, self.server_dtype)
            timer.lap("verify_s")
            self._admin(self.client.continue_generation, version, "continue_generation")
            timer.lap("continue_s")
        finally:
            shutil.rmtree(path, ignore_errors=True)
        barrier()
        out = timer.total()
        out.update(bytes=float(n_bytes), n_tensors=float(n_tensors))
        logger.info("pushed version %d from disk: %d tensors, %.1f MB, %.3fs",
                    version, n_tensors, n_bytes / 2**20, out["total_s"])
        return out

    def close(self) -> None:
        """Remove the scratch directory if it is empty (it holds nothing between updates)."""
        try:
            self.root.rmdir()
        except OSError:
            pass
