"""Vision batches for the trainer and push tests: the tiny Qwen2.5-VL (``vl-micro``) and
right-padded batches whose rows hold 0, 1 or 2 images (the trajectory keys of docs/vision.md)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch


def png(seed: int, size: tuple[int, int]) -> bytes:
    """A random RGB image (``size`` = (height, width)) as PNG bytes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


#: Each row's images (by seed and size) and the number of completion tokens after the prompt.
ROWS = [
    ([], 7),
    ([(1, (56, 56))], 5),
    ([(2, (56, 84)), (3, (84, 56))], 6),
    ([(4, (112, 56))], 4),
]


def vision_batch(model_dir: Path, rows=ROWS, seed: int = 0) -> dict[str, torch.Tensor]:
    """A right-padded batch of ``rows``: ``input_ids``/``attention_mask``/``loss_mask`` ``[B, L]``,
    ``pixel_values [B, P, D]``, ``image_grid_thw [B, N, 3]`` (zero-padded)."""
    from arealite.vision.processor import load_processor
    from arealite.vision.prompt import render_vision_prompt

    processor = load_processor(model_dir)
    gen = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for i, (images, n_new) in enumerate(rows):
        text = "Look: " + " and ".join("<image>" for _ in images) + f" row {i}?"
        prompts.append(render_vision_prompt(processor, text, [png(s, hw) for s, hw in images]))
        completions.append(torch.randint(10, 200, (n_new,), generator=gen).tolist())
    B = len(rows)
    L = max(len(p.input_ids) + len(c) for p, c in zip(prompts, completions))
    P = max(1, max(p.pixel_values.shape[0] for p in prompts))
    N = max(1, max(p.image_grid_thw.shape[0] for p in prompts))
    D = prompts[0].pixel_values.shape[1]
    batch = {"input_ids": torch.zeros(B, L, dtype=torch.long), "attention_mask": torch.zeros(B, L, dtype=torch.bool),
             "loss_mask": torch.zeros(B, L, dtype=torch.bool), "pixel_values": torch.zeros(B, P, D),
             "image_grid_thw": torch.zeros(B, N, 3, dtype=torch.long)}
    for b, (p, c) in enumerate(zip(prompts, completions)):
        ids = p.input_ids + c
        batch["input_ids"][b, :len(ids)] = torch.tensor(ids)
        batch["attention_mask"][b, :len(ids)] = True
        batch["loss_mask"][b, len(p.input_ids):len(ids)] = True
        batch["pixel_values"][b, :p.pixel_values.shape[0]] = p.pixel_values
        batch["image_grid_thw"][b, :p.image_grid_thw.shape[0]] = p.image_grid_thw
    return batch


def hf_row_logprobs(model, batch: dict[str, torch.Tensor], b: int) -> torch.Tensor:
    """Log-probs ``[n]`` of row ``b``'s tokens 1..n-1 under a plain HF forward of that row alone
    (the model computes its own 3-D positions); position 0 is 0, as the engine writes it."""
    n = int(batch["attention_mask"][b].sum())
    ids = batch["input_ids"][b, :n][None]
    grid = batch["image_grid_thw"][b]
    grid = grid[(grid != 0).any(-1)]
    kwargs = {}
    if grid.shape[0]:
        kwargs = dict(pixel_values=batch["pixel_values"][b, :int(grid.prod(-1).sum())], image_grid_thw=grid,
                      mm_token_type_ids=(ids == model.config.image_token_id).int())
    with torch.no_grad():
        logits = model(input_ids=ids, **kwargs).logits[0].float()
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    return torch.cat([torch.zeros(1), logp])
