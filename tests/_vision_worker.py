"""The vision training scenario, run by tests/test_vision_train.py under ``torchrun`` (2 gloo
ranks, each with half the rows) and in one process (all rows): the same batch with images (one
micro-batch per rank), a cross-entropy step then a decoupled PPO step (behaviour log-probs off the trainer's); saves
each step's stats, the log-probs before training and the full weights after."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _fsdp_worker import full_weights, n_loss_tokens, token_mean_ce  # noqa: E402
from vision_batches import ROWS, vision_batch  # noqa: E402

from arealite.algo.actor import PPOActor  # noqa: E402
from arealite.config.schema import ActorConfig, AlgorithmConfig, LoraConfig  # noqa: E402
from arealite.train_engine.fsdp import FSDPEngine  # noqa: E402


def engine_for(model_dir: str, freeze_vision: bool = False, lora: bool = False, mb_max_tokens: int = 60,
               sp_size: int = 1) -> FSDPEngine:
    cfg = ActorConfig(model_path=model_dir, mb_max_tokens=mb_max_tokens, freeze_vision=freeze_vision,
                      lora=LoraConfig(rank=3, alpha=6.0) if lora else None, sp_size=sp_size)
    cfg.optimizer.lr = 1e-2 if lora else 2e-3
    cfg.optimizer.gradient_clipping = 0.5
    if lora:
        from arealite.lora import LoraFSDPEngine

        return LoraFSDPEngine(cfg, device="cpu").initialize(total_steps=4)
    return FSDPEngine(cfg, device="cpu").initialize(total_steps=4)


def label_logprobs(head, mb: dict) -> torch.Tensor:
    return head.logprobs(mb["labels"])


def steps(engine: FSDPEngine, batch: dict, rows: slice) -> dict:
    """Log-probs, a cross-entropy step, a decoupled PPO step; stats and weights."""
    part = {k: v[rows] for k, v in batch.items()}
    logp = engine.forward(part, label_logprobs)
    stats = [engine.train_batch(part, token_mean_ce, n_loss_tokens)]
    B, L = batch["input_ids"].shape
    wiggle = (0.1 * torch.sin(torch.arange(B * L, dtype=torch.float32)).reshape(B, L))[rows]
    adv = torch.cos(torch.arange(B * L, dtype=torch.float32)).reshape(B, L)[rows]
    data = {**part, "logprobs": torch.where(part["loss_mask"], logp + wiggle, torch.zeros(())), "advantages": adv}
    actor = PPOActor(AlgorithmConfig(use_decoupled_loss=True), engine, temperature=1.0)
    stats.append(engine.train_batch(data, actor.loss_fn(), actor.loss_weight_fn()))
    return {"logp": logp, "stats": stats, "weights": full_weights(engine)}


#: Rows that all hold images.
IMAGE_ROWS = ROWS[1:] + [([(5, (56, 56))], 3)]


def image_feeds(engine: FSDPEngine, part: dict) -> list[tuple | str]:
    """Per micro-batch of ``part``: what this rank's vision tower ran ("model": the model took the
    images; "blank"; or its slots, images run and the features kept)."""
    out = []
    for mb, _ in engine.planner.plan(engine.planner.rows(part).data):
        feed = engine.planner.image_feed(mb)
        if feed is None or feed.slots is None:
            out.append("model" if feed is None else "blank")
        else:
            out.append((int(feed.slots.sum()), int(feed.image_grid_thw.shape[0]), feed.keep.start, feed.keep.stop))
    return out


def run(model_dir: str, out_dir: str, lora: bool = False, mixed: bool = False, sp: bool = False) -> dict:
    """The scenario: one micro-batch per rank of rows with images (``mixed``: micro-batches of at
    most 60 tokens over rows with 0, 1, 2 and 1 images, so rank 0's first has no image while
    rank 1's has two; ``sp``: the two ranks split each micro-batch of all rows, sp_size=2)."""
    engine = engine_for(model_dir, lora=lora, mb_max_tokens=60 if mixed else 1000, sp_size=2 if sp else 1)
    batch = vision_batch(Path(model_dir), rows=ROWS if mixed else IMAGE_ROWS)
    B = batch["input_ids"].shape[0]
    rank, world = engine.rank, engine.world_size
    rows = slice(0, B) if world == 1 else (slice(0, B // 2) if rank == 0 else slice(B // 2, B))
    feeds = image_feeds(engine, {k: v[rows] for k, v in batch.items()}) if sp else []
    result = {**steps(engine, batch, rows), "image_feeds": feeds}
    if world > 1:
        torch.save(result, Path(out_dir) / f"result_rank{rank}.pt")
    engine.destroy()
    return result


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], lora="lora" in sys.argv[3:], mixed="mixed" in sys.argv[3:], sp="sp" in sys.argv[3:])
