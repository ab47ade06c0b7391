"""Build the tool-use demo offline: a tiny model, the data, and a short supervised warm-up.

    python examples/tool_use/prepare.py --out runs/tool_demo

writes ``OUT/base_model`` (random tiny Qwen2-style model; its tokenizer is also trained on
the task's tool-call markup, and its chat template offers tools and renders tool calls in
the Hermes/Qwen form), ``OUT/train.jsonl`` / ``OUT/eval.jsonl`` (disjoint pairs of 4-digit
numbers to multiply) and ``OUT/model``: the warmed-up starting policy for RL.

The warm-up traces use the tool only part of the time (``--tool-fraction``): in the others
the model answers at once with a wrong guess. A ~1M-parameter model cannot multiply 4-digit
numbers, so the starting policy is right only when it happens to call the calculator and copy
its result; greedy, it mostly guesses. RL has to find out that the tool pays.

Each trace is tokenized exactly as the agent endpoint will render the conversation (the
prompt with the tools, the sampled reply, the tool turn cut after the reply), so the
warm-up trains on the token sequences RL will see.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch
from tensordict import TensorDict
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent import TOOLS, make_items  # noqa: E402  (examples/tool_use/agent.py)

from arealite.agent.chat import ChatRenderer  # noqa: E402
from arealite.models.tiny import build_tiny_model  # noqa: E402
from arealite.models.supervised_warm_start import demo_arguments, start_demo_dir, supervised_warm_up  # noqa: E402
from arealite.reward.reverse_digits import write_jsonl  # noqa: E402


def tool_call_text(a: int, b: int) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a} * {b}"}}}}</tool_call>'


def answer_text(n: int) -> str:
    return f"The answer is {n}."


def tokenizer_corpus(seed: int, n: int = 1500) -> list[str]:
    """Task text for the tokenizer, so that tool-call markup gets merges of its own."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(1000, 9999), rng.randint(1000, 9999)
        lines += [tool_call_text(a, b), answer_text(a * b), f"What is {a} * {b}?", "Tools: calculator"]
    return lines


def guess(a: int, b: int) -> int:
    """What the model says without the tool: the leading digits' product, padded with zeros
    (4821 * 3907 -> 12000000). Of the right size, cheap to learn, never right (a pair whose
    product it is, like 4000 * 3000, is not in the data)."""
    return int(str(a)[0]) * int(str(b)[0]) * 10**6


class TraceBuilder:
    """Token ids and loss masks of warm-up conversations, rendered as the endpoint renders them."""

    def __init__(self, tok):
        self.tok, self.r = tok, ChatRenderer(tok)
        self.eot = self.r.end_of_turn
        if self.eot is None:
            raise ValueError("the tokenizer's chat template has no end-of-turn token")

    def _reply(self, text: str) -> list[int]:
        return self.r.encode(text) + [self.eot]

    def trace(self, item: dict, kind: str) -> tuple[list[int], list[bool]]:
        """``kind``: ``guess`` (answer at once), ``tool`` (call the calculator, then answer) or
        ``tool_no_choice`` (the same trace, but the reply's first token, the choice to call
        the tool, is left out of the loss)."""
        a, b = item["a"], item["b"]
        msgs = [{"role": "user", "content": item["prompt"]}]
        ids = self.r.prompt_ids(msgs, TOOLS)
        mask = [False] * len(ids)
        if kind == "guess":
            reply = self._reply(answer_text(guess(a, b)))
            return ids + reply, mask + [True] * len(reply)
        call = self._reply(tool_call_text(a, b))
        args = f'{{"expression": "{a} * {b}"}}'
        msgs += [{"role": "assistant", "content": "", "tool_calls": [
                     {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": args}}]},
                 {"role": "tool", "tool_call_id": "call_0", "content": str(a * b)}]
        piece = self.r.continuation_ids(msgs, TOOLS, None, 1, call)
        final = self._reply(answer_text(a * b))
        ids = ids + call + piece + final
        mask = mask + [kind == "tool"] + [True] * (len(call) - 1) + [False] * len(piece) + [True] * len(final)
        return ids, mask

    def batch(self, rows: list[tuple[list[int], list[bool]]]) -> TensorDict:
        L, B = max(len(i) for i, _ in rows), len(rows)
        pad = self.tok.pad_token_id
        input_ids = torch.full((B, L), pad, dtype=torch.long)
        attention_mask = torch.zeros((B, L), dtype=torch.bool)
        loss_mask = torch.zeros((B, L), dtype=torch.bool)
        for k, (ids, mask) in enumerate(rows):
            input_ids[k, : len(ids)] = torch.tensor(ids)
            attention_mask[k, : len(ids)] = True
            loss_mask[k, : len(ids)] = torch.tensor(mask)
        return TensorDict({"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask},
                          batch_size=[B])


def trace_kinds(n: int, tool_fraction: float, copy_fraction: float, rng: random.Random) -> list[str]:
    """Kinds of ``n`` warm-up traces: ``copy_fraction`` of them teach the tool call and reading
    its result without the choice; of the others, ``tool_fraction`` choose the tool."""
    kinds = []
    for _ in range(n):
        if rng.random() < copy_fraction:
            kinds.append("tool_no_choice")
        else:
            kinds.append("tool" if rng.random() < tool_fraction else "guess")
    return kinds


def warm_up(model_dir: Path, out_dir: Path, items: list[dict], steps: int, batch_size: int,
            tool_fraction: float, copy_fraction: float, lr: float, seed: int) -> None:
    builder = TraceBuilder(AutoTokenizer.from_pretrained(model_dir))

    def next_batch(rng: random.Random) -> TensorDict:
        kinds = trace_kinds(batch_size, tool_fraction, copy_fraction, rng)
        return builder.batch([builder.trace(rng.choice(items), k) for k in kinds])

    supervised_warm_up(model_dir, out_dir, next_batch, steps=steps, lr=lr, seed=seed, mb_max_tokens=8192,
                       lr_warmup_steps=50)


def main(argv: list[str] | None = None) -> None:
    p = demo_arguments(__doc__, out="runs/tool_demo", n_eval=100, warmup_steps=1000,
                       batch_size=32, lr=2e-3)
    p.add_argument("--tool-fraction", type=float, default=0.3,
                   help="share of warm-up traces that choose to call the calculator (the rest guess)")
    p.add_argument("--copy-fraction", type=float, default=0.5,
                   help="share of extra tool traces whose choice to call the tool is not trained")
    args = p.parse_args(argv)
    out = start_demo_dir(args)
    if out is None:
        return
    base = build_tiny_model(out / "base_model", size=args.size, seed=args.seed,
                            extra_corpus=tokenizer_corpus(args.seed))
    eval_items = make_items(args.n_eval, seed=args.seed + 1000)
    train_items = make_items(args.n_train, seed=args.seed, exclude={(it["a"], it["b"]) for it in eval_items})
    write_jsonl(train_items, out / "train.jsonl")
    write_jsonl(eval_items, out / "eval.jsonl")
    print(f"[prepare] model {base}, {len(train_items)} train / {len(eval_items)} held-out prompts")
    warm_up(base, out / "model", train_items, args.warmup_steps, args.batch_size, args.tool_fraction,
            args.copy_fraction, args.lr, args.seed)
    print(f"[prepare] warmed-up starting policy written to {out / 'model'}")


if __name__ == "__main__":
    main()
