"""The vision tower under sequence parallelism: each rank on its own images, or on all of them.

A packed micro-batch of ``--rows`` rows, each ``--text`` text tokens around one image (sizes
cycling over ``--sizes``, pixels), is split over ``sp`` ranks by tokens as the engine splits it
(`SequenceParallel.token_range`). Per rank, the script runs a Qwen2.5-VL vision tower (transformers'
own, ``--hidden``/``--depth``; float32 on the CPU, one process: the tower's own cost, no
communication) forward and backward on

- ``whole``: every image of the micro-batch (what each rank would run if the tower ran whole);
- ``own``: the images overlapping the rank's tokens (`sequence_images.local_images`, what the
  engine runs), a cut image on both ranks that share it.

and reports per rank the CPU time of the process (one thread; CPU time rather than wall time,
as other jobs share the machine: median over ``--rounds``, the runs interleaved, and the spread
min-max) and the bytes autograd saves for the backward (``saved_tensors_hooks``, each storage
once: the tower's activation memory). The figure of a layout is its slowest rank's time and
its largest rank's bytes.

    python benchmarks/bench_vision_sp.py [--sp 2 4] [--rows 8] [--rounds 5]

The last line is one JSON object: per ``sp``, ``whole``/``own`` time (s) and saved bytes, and
the ratios ``own ÷ whole``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arealite.train_engine.parallel.sequence_images import local_images  # noqa: E402

PATCH, MERGE, TEMPORAL = 14, 2, 2


def tower(hidden: int, depth: int):
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    cfg = Qwen2_5_VLVisionConfig(depth=depth, hidden_size=hidden, intermediate_size=2 * hidden, num_heads=hidden // 64,
                                 out_hidden_size=hidden, patch_size=PATCH, spatial_merge_size=MERGE,
                                 temporal_patch_size=TEMPORAL, window_size=112,
                                 fullatt_block_indexes=list(range(depth - 1, depth)))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2_5_VisionTransformerPretrainedModel(cfg).float()


def micro_batch(rows: int, text: int, sizes: list[tuple[int, int]]):
    """Image slots ``[T]``, ``pixel_values [P, D]`` and ``image_grid_thw [rows, 3]`` of the packed rows."""
    slots, grids = [], []
    for r in range(rows):
        h, w = sizes[r % len(sizes)]
        grid = (1, h // PATCH, w // PATCH)
        n = grid[1] * grid[2] // MERGE ** 2
        slots += [False] * (text // 2) + [True] * n + [False] * (text - text // 2)
        grids.append(grid)
    grid = torch.tensor(grids)
    dim = 3 * TEMPORAL * PATCH ** 2
    pixels = torch.randn(int(grid.prod(-1).sum()), dim, generator=torch.Generator().manual_seed(1))
    return torch.tensor(slots), pixels, grid


def run_tower(model, pixels: torch.Tensor, grid: torch.Tensor) -> tuple[float, int]:
    """Forward and backward of the tower on ``pixels``: CPU seconds and bytes saved for the backward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    model.zero_grad(set_to_none=True)
    start = time.process_time()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(pixels, grid_thw=grid).pooler_output
    out.square().mean().backward()
    return time.process_time() - start, sum(seen.values())


def jobs(slots, pixels, grid, sps: list[int]) -> dict[tuple, tuple[torch.Tensor, torch.Tensor]]:
    """The tower runs to time: ``("whole",)`` and ``("own", sp, rank)`` for each rank with images."""
    out = {("whole",): (pixels, grid)}
    for sp in sps:
        per_rank = -(-slots.shape[0] // sp)
        for r in range(sp):
            feed = local_images(slots, pixels, grid, MERGE, slice(r * per_rank, (r + 1) * per_rank))
            if feed is not None:
                out[("own", sp, r)] = (feed.pixel_values, feed.image_grid_thw)
    return out


def measure(model, runs: dict, rounds: int) -> dict[tuple, dict]:
    """Each run ``rounds`` times, interleaved (the order reversed every other round)."""
    times: dict[tuple, list[float]] = {k: [] for k in runs}
    saved: dict[tuple, int] = {}
    for i in range(rounds):
        for key in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
            t, saved[key] = run_tower(model, *runs[key])
            times[key].append(t)
    return {k: {"time_s": statistics.median(v), "time_min_s": min(v), "time_max_s": max(v),
                "saved_bytes": saved[k], "images": int(runs[k][1].shape[0])} for k, v in times.items()}


def layout_figures(figures: dict[tuple, dict], sp: int) -> dict:
    """``whole`` and ``own`` (the rank with the largest median time) of one ``sp``, and own ÷ whole."""
    whole = figures[("whole",)]
    own = max((v for k, v in figures.items() if k[0] == "own" and k[1] == sp), key=lambda v: v["time_s"])
    saved = max(v["saved_bytes"] for k, v in figures.items() if k[0] == "own" and k[1] == sp)
    own = {**own, "saved_bytes": saved}
    return {"whole": whole, "own": own, "time_ratio": own["time_s"] / whole["time_s"],
            "saved_ratio": saved / whole["saved_bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--text", type=int, default=200, help="text tokens per row")
    ap.add_argument("--sizes", default="224x224,448x224,224x448,112x112", help="image sizes, HxW pixels")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    model = tower(args.hidden, args.depth)
    slots, pixels, grid = micro_batch(args.rows, args.text, sizes)
    run_tower(model, pixels, grid)  # warm-up
    figures = measure(model, jobs(slots, pixels, grid, args.sp), args.rounds)
    result = {"tokens": int(slots.shape[0]), "image_tokens": int(slots.sum()), "patches": int(pixels.shape[0])}
    for sp in args.sp:
        result[f"sp{sp}"] = m = layout_figures(figures, sp)
        print(f"sp={sp}: whole {m['whole']['time_s']:.3f}s ({m['whole']['saved_bytes'] / 2**20:.0f} MiB saved), "
              f"own {m['own']['time_s']:.3f}s ({m['own']['saved_bytes'] / 2**20:.0f} MiB saved, "
              f"{m['own']['images']} of {grid.shape[0]} images)", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
