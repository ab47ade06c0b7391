"""Build the vision-language CPU demo offline: a tiny VLM, images drawn with PIL, a warm-up.

    python examples/vision/prepare.py --out runs/vision_demo

Task: a white 56x56 image shows 1 to 4 shapes (squares or discs, red, blue or green), each in
its own quadrant; the model answers how many (1-4). Each merged image token covers exactly one
quadrant, so each only has to say whether it holds a shape: no absolute position is needed.
The reward is exact match (`arealite.reward.math:math_reward`).

Writes ``OUT/base_model`` (a random Qwen2.5-VL of size ``vl-micro``: vision tower, processor,
chat template), ``OUT/images/*.png`` with ``OUT/train.jsonl`` / ``OUT/eval.jsonl`` (rows
``{"prompt": "<image>...", "answer": "3", "images": ["images/train_00012.png"]}``, paths
relative to the data file) and ``OUT/model``: the warmed-up starting policy for RL.

The warm-up (a plain PyTorch loop over the Hugging Face model, images through its
processor) is deliberately imperfect, as in the other demos: its answers are right for
one shape and, for 2-4 shapes, right only ``--right-fraction`` of the time, one shape too few
otherwise. The starting policy therefore tells the images apart but answers greedily right
only for about a quarter of them; RL with the
verifiable reward has to find and reinforce the right answer.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from pathlib import Path

import torch

from arealite.models.tiny import build_tiny_model
from arealite.vision.processor import load_processor

# Short on purpose: the prompt's tokens are most of a tiny model's compute.
PROMPT = "<image>How many shapes: 1, 2, 3 or 4?"
SIDE = 56
# Quadrant q (1-4): its top-left corner in the image.
CORNERS = {1: (0, 0), 2: (SIDE // 2, 0), 3: (0, SIDE // 2), 4: (SIDE // 2, SIDE // 2)}
# The warm-up's systematic wrong answer: one shape too few.
WRONG = {2: 1, 3: 2, 4: 3}
COLOURS = [(220, 0, 0), (0, 90, 255), (0, 170, 0)]


def draw(rng: random.Random, count: int):
    """A white 56x56 image with ``count`` shapes, each in a different quadrant."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIDE, SIDE), (255, 255, 255))
    pen = ImageDraw.Draw(img)
    for q in rng.sample(sorted(CORNERS), count):
        size = rng.randint(14, 20)
        x0, y0 = CORNERS[q]
        x, y = x0 + rng.randint(1, SIDE // 2 - size - 1), y0 + rng.randint(1, SIDE // 2 - size - 1)
        shape = pen.rectangle if rng.random() < 0.5 else pen.ellipse
        shape([x, y, x + size, y + size], fill=rng.choice(COLOURS))
    return img


def write_split(out: Path, split: str, n: int, seed: int) -> list[dict]:
    """Draw ``n`` images into ``out/images`` and write ``out/{split}.jsonl``; return the rows."""
    rng = random.Random(seed)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        q = rng.randint(1, 4)
        name = f"images/{split}_{i:05d}.png"
        draw(rng, q).save(out / name)
        rows.append({"prompt": PROMPT, "answer": str(q), "images": [name]})
    with open(out / f"{split}.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


class Encoded:
    """Every row rendered once through the processor: prompt ids (all of one length: the
    images share a size), each image's patches, and the answer's token."""

    def __init__(self, processor, hf_config, rows: list[dict], base: Path):
        from arealite.vision.prompt import render_vision_prompt
        from arealite.vision.rope import mrope_positions

        tok = processor.tokenizer
        self.answer_ids = {q: tok.encode(str(q), add_special_tokens=False)[0] for q in CORNERS}
        self.eot = tok.convert_tokens_to_ids("<|im_end|>")
        prompts = [render_vision_prompt(processor, r["prompt"], [(base / r["images"][0]).read_bytes()])
                   for r in rows]
        self.ids = torch.tensor([p.input_ids for p in prompts])
        self.pixels = torch.stack([p.pixel_values for p in prompts])  # [N, P, D]
        self.grid = prompts[0].image_grid_thw  # [1, 3], the same for every row
        self.answers = [int(r["answer"]) for r in rows]
        # The 3-D rope positions of prompt + answer + end of turn, as the server and trainer
        # compute them (`arealite.vision.rope`). transformers' forward builds them itself only
        # when it is given the processor's ``mm_token_type_ids``; without either it silently
        # uses 1-D positions, and a policy warmed up that way sees other images under arealite.
        row = torch.cat([self.ids[0], torch.tensor([self.answer_ids[1], self.eot])])
        self.positions = mrope_positions(hf_config, row, self.grid)  # [3, L + 2]

    def batch(self, index: list[int], labels: list[int]) -> dict[str, torch.Tensor]:
        """Inputs and labels of rows ``index`` answered with ``labels`` (+ end of turn)."""
        answer = torch.tensor([[self.answer_ids[q], self.eot] for q in labels])
        ids = torch.cat([self.ids[index], answer], dim=1)
        target = torch.full_like(ids, -100)
        target[:, -2:] = answer
        return {"input_ids": ids, "labels": target, "pixel_values": self.pixels[index].flatten(0, 1),
                "image_grid_thw": self.grid.repeat(len(index), 1),
                "position_ids": self.positions[:, None].expand(-1, len(index), -1)}


@torch.no_grad()
def greedy_accuracy(model, data: Encoded, batch_size: int = 100) -> float:
    """Share of rows whose greedy first answer token is the right count."""
    right = 0
    by_id = {v: q for q, v in data.answer_ids.items()}
    for start in range(0, len(data.answers), batch_size):
        index = list(range(start, min(start + batch_size, len(data.answers))))
        b = data.batch(index, [1] * len(index))
        n = data.ids.shape[1]
        logits = model(input_ids=b["input_ids"][:, :n], pixel_values=b["pixel_values"],
                       image_grid_thw=b["image_grid_thw"], position_ids=b["position_ids"][..., :n]).logits[:, -1]
        right += sum(by_id.get(int(t)) == data.answers[i] for i, t in zip(index, logits.argmax(-1)))
    return right / len(data.answers)


def warm_up(model_dir: Path, out_dir: Path, train: Encoded, held_out: Encoded, args) -> None:
    """A plain supervised loop on imperfect labels; exports the policy to ``out_dir``."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(args.seed)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng = random.Random(args.seed)
    t0 = time.time()
    for step in range(1, args.warmup_steps + 1):
        index = [rng.randrange(len(train.answers)) for _ in range(args.batch_size)]
        labels = [q if q == 1 or rng.random() < args.right_fraction else WRONG[q]
                  for q in (train.answers[i] for i in index)]
        loss = model(**train.batch(index, labels)).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == args.warmup_steps:
            model.eval()
            acc = greedy_accuracy(model, held_out)
            model.train()
            print(f"[warm-up] step {step}/{args.warmup_steps}  loss {loss.item():.3f}  "
                  f"held-out greedy accuracy {acc:.1%}  ({time.time() - t0:.0f}s)", flush=True)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in model_dir.iterdir():  # the processor, tokenizer and chat template travel with it
        if f.suffix in (".json", ".jinja") and f.name not in ("config.json", "generation_config.json"):
            shutil.copy(f, tmp / f.name)
    (tmp / "generation_config.json").unlink(missing_ok=True)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/vision_demo", help="directory for the model, images and data")
    p.add_argument("--size", default="vl-micro", help="tiny VLM size (vl-micro | vl-small)")
    p.add_argument("--n-train", type=int, default=1000)
    p.add_argument("--n-eval", type=int, default=200)
    p.add_argument("--warmup-steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--right-fraction", type=float, default=0.3,
                   help="share of warm-up answers for 2-4 shapes that are right (the rest: one too few)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if OUT/model exists")
    args = p.parse_args(argv)
    out = Path(args.out)
    if (out / "model" / "config.json").exists() and not args.force:
        print(f"[prepare] {out / 'model'} exists; reusing it (pass --force to rebuild)")
        return
    torch.manual_seed(args.seed)
    base = build_tiny_model(out / "base_model", size=args.size, seed=args.seed)
    train_rows = write_split(out, "train", args.n_train, args.seed)
    eval_rows = write_split(out, "eval", args.n_eval, args.seed + 1000)
    print(f"[prepare] model {base}, {len(train_rows)} train / {len(eval_rows)} held-out images")
    from transformers import AutoConfig

    processor, hf_config = load_processor(base), AutoConfig.from_pretrained(base)
    warm_up(base, out / "model", Encoded(processor, hf_config, train_rows, out),
            Encoded(processor, hf_config, eval_rows, out), args)
    print(f"[prepare] warmed-up starting policy written to {out / 'model'}")


if __name__ == "__main__":
    main()
