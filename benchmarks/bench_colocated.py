"""What the colocated placement's server side costs: the push by tensor handles against a
plain memory copy of the same bytes, and the release / resume of the server's memory.

One embedded server (``--enable-memory-saver``) on a tiny model; this process plays the
trainer. Each round, interleaved:

- memcpy (the baseline): ``dst.copy_(src)`` for every tensor of the checkpoint, in this
  process, from the trainer's buffer into a second set of tensors of the same shapes
  (the one copy any push must make);
- push: one ``/update_weights_from_tensor`` call (session open) carrying every tensor as
  a handle into the trainer's shared-memory buffer (CPU) or its CUDA tensors (CUDA IPC),
  timed from the client's call to the server's answer: pickling the handles, HTTP, the
  server mapping the memory, checking and copying into its weights between two steps;
- transfer: the whole `TensorTransfer.transfer` (staging copy into the shared buffer,
  begin/end of the session, per-bucket calls) for the figure a trainer sees;
- release / resume: ``/release_memory_occupation`` and ``/resume_memory_occupation``
  (all tags) with the server paused, and the memory each frees or takes back (the
  server's RSS on CPU; ``torch.cuda.memory_allocated`` in the server on a GPU).

    python benchmarks/bench_colocated.py                    # "base" model (~10M, 40 MB), 9 rounds
    python benchmarks/bench_colocated.py --size large       # ~50M parameters
    python benchmarks/bench_colocated.py --device cuda      # server and tensors on the GPU

Goal: ``tensor_push_over_memcpy`` <= 1.5 on CPU (median of the rounds). The last line
printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arealite.config.schema import WeightSyncConfig  # noqa: E402
from arealite.inference_client.sglang_client import SGLangClient  # noqa: E402
from arealite.server.process import ServerProcess  # noqa: E402
from arealite.utils.net import free_port  # noqa: E402
from arealite.weight_sync import StateDictSource, TensorTransfer  # noqa: E402
from arealite.weight_sync.tensor import pack_into, packed_bytes, shared_buffer  # noqa: E402


def _loop_runner():
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(600)


def _checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _shared_copy(state: dict[str, torch.Tensor], device: str) -> list[tuple[str, torch.Tensor]]:
    """The trainer's weights as views of one buffer in shared memory (CPU) or on the GPU."""
    if device == "cuda":
        return [(k, v.to("cuda")) for k, v in state.items()]
    named = list(state.items())
    return pack_into(shared_buffer(packed_bytes(named)), named)


def _server_memory(admin, run) -> int:
    """The server's own measure of what it holds: CUDA memory allocated, else its RSS."""
    (info,) = run(admin.pool.call_all("/server_info", method="GET")).values()
    mem = info["internal_states"][0]["memory"]
    return int(mem.get("cuda_memory_allocated", mem["rss_bytes"]))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=["small", "base", "large"], default="base")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--model-dir", default=None, help="reuse a tiny model directory")
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="bench_colocated_")
    model_dir = Path(args.model_dir) if args.model_dir else None
    if model_dir is None:
        from arealite.models.tiny import build_tiny_model

        model_dir = build_tiny_model(Path(tmp.name) / "model", size=args.size, seed=0)
    state = _checkpoint(model_dir)
    n_bytes = sum(v.numel() * v.element_size() for v in state.values())
    named = _shared_copy(state, args.device)
    dst = {k: torch.empty_like(v) for k, v in named}
    run = _loop_runner()

    server = ServerProcess(model_dir, free_port(), threads=1, log_path=Path(tmp.name) / "server.log",
                           extra_args=["--enable-memory-saver", "--device", args.device])
    try:
        server.wait_healthy(300)
        client = SGLangClient([server.url.removeprefix("http://")])
        run(client.initialize(120))
        admin = client.admin
        transfer = TensorTransfer(WeightSyncConfig(bucket_size_mb=64.0, timeout_s=300), admin, run)
        transfer.init()
        source = StateDictSource(state if args.device == "cpu" else dict(named))  # tensors of their own storage
        rows: dict[str, list[float]] = {k: [] for k in (
            "memcpy_s", "push_s", "release_s", "resume_s", "release_freed_mb", "resume_taken_mb")}
        run(admin.pause_generation())
        for r in range(args.rounds + 1):  # round 0 warms both paths up and is not counted
            _sync(args.device)
            t0 = time.perf_counter()
            for k, v in named:
                dst[k].copy_(v)
            _sync(args.device)
            memcpy_s = time.perf_counter() - t0

            run(admin.begin_weight_update())
            t0 = time.perf_counter()
            run(admin.update_weights_from_tensor(named, r + 1))
            push_s = time.perf_counter() - t0
            run(admin.end_weight_update())

            m0 = _server_memory(admin, run)
            t0 = time.perf_counter()
            run(admin.release_memory_occupation())
            release_s = time.perf_counter() - t0
            m1 = _server_memory(admin, run)
            t0 = time.perf_counter()
            run(admin.resume_memory_occupation())
            resume_s = time.perf_counter() - t0
            m2 = _server_memory(admin, run)
            if r == 0:
                first_push_s = push_s
                continue
            for k, v in (("memcpy_s", memcpy_s), ("push_s", push_s), ("release_s", release_s),
                         ("resume_s", resume_s), ("release_freed_mb", (m0 - m1) / 2**20),
                         ("resume_taken_mb", (m2 - m1) / 2**20)):
                rows[k].append(v)
        # The whole transfer a trainer runs (its own staging buffer, so measured apart: the
        # server keeps one mapping, that of the last push).
        transfer_rows = []
        for r in range(args.rounds + 1):
            t0 = time.perf_counter()
            transfer.transfer(source, 100 + r)
            transfer_rows.append(time.perf_counter() - t0)
        rows["transfer_s"] = transfer_rows[1:]
        transfer.close()
        run(admin.continue_generation())
        run(client.aclose())
    finally:
        server.stop()

    ratios = [p / m for p, m in zip(rows["push_s"], rows["memcpy_s"])]
    transfer_ratios = [t / statistics.median(rows["memcpy_s"]) for t in rows["transfer_s"]]
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"device {args.device}, model {args.size}: {len(named)} tensors, {n_bytes / 2**20:.1f} MB; "
          f"{args.rounds} rounds (after one warm-up), interleaved")
    print(f"{'phase':<22}{'median':>12}{'min':>12}{'max':>12}")
    for k, v in rows.items():
        print(f"{k:<22}{med[k]:>12.4f}{min(v):>12.4f}{max(v):>12.4f}")
    print(f"{'push / memcpy':<22}{statistics.median(ratios):>12.2f}{min(ratios):>12.2f}{max(ratios):>12.2f}")
    print(f"first push (maps the trainer's buffer): {first_push_s:.4f}s")
    print(f"{'transfer / memcpy':<22}{statistics.median(transfer_ratios):>12.2f}"
          f"{min(transfer_ratios):>12.2f}{max(transfer_ratios):>12.2f}")
    print(json.dumps({
        "tensor_push_over_memcpy": round(statistics.median(ratios), 3),
        "tensor_push_over_memcpy_spread": [round(min(ratios), 3), round(max(ratios), 3)],
        "tensor_transfer_over_memcpy": round(statistics.median(transfer_ratios), 3),
        "first_push_s": round(first_push_s, 4), "rounds": args.rounds, "device": args.device, "model": args.size, "bytes": n_bytes,
        **{k: round(v, 4) for k, v in med.items()},
        "weights_mb": round(n_bytes / 2**20, 2),
    }))


if __name__ == "__main__":
    main()
