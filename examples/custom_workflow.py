"""A user-written workflow in one page: "answer, then check your own answer".

The model answers a math question; the workflow then asks it (same
conversation, token-in/token-out) to restate only the final number. The
trajectory is rewarded 1.0 if both the answer and the restated number are
right, 0.5 if only the answer is. Only the model's own tokens are trained on.

Run it against the embedded server on the tiny model (no GPU needed):

    python examples/custom_workflow.py
or against running servers:

    python examples/custom_workflow.py --addr 127.0.0.1:30000 --model-path MODEL_DIR
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arealite.api.types import GenerationRequest, SamplingParams  # noqa: E402
from arealite.config.schema import RolloutConfig  # noqa: E402
from arealite.reward.math import answers_match, extract_final_answer  # noqa: E402
from arealite.workflow.base import (  # noqa: E402
    RewardRunner,
    RolloutWorkflow,
    new_group_id,
    pad_and_stack,
    trajectory_row,
)


class AnswerThenCheck(RolloutWorkflow):
    """Two model turns per sample, ``n`` samples per prompt (one GRPO group)."""

    def __init__(self, tokenizer, n: int = 2, max_new_tokens: int = 16):
        self.tok = tokenizer
        self.n = n
        self.sampling = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=[tokenizer.eos_token_id])
        self.reward = RewardRunner(timeout_s=5.0)  # scoring runs off the event loop

    def _piece(self, text: str) -> list[int]:
        # The tokens of "end the assistant turn, a user turn, start the assistant turn".
        return self.tok.encode(f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
                               add_special_tokens=False)

    def _score(self, first: str, second: str, answer) -> float:
        ok1 = answers_match(extract_final_answer(first), answer)
        ok2 = answers_match(extract_final_answer(second), answer)
        return 1.0 if ok1 and ok2 else 0.5 if ok1 else 0.0

    async def _sample(self, engine, prompt_ids: list[int], answer, key: str):
        first = await engine.agenerate(GenerationRequest(prompt_ids, self.sampling, affinity_key=key))
        check = self._piece("Restate only the final number.")
        second = await engine.agenerate(
            GenerationRequest(prompt_ids + first.output_ids + check, self.sampling, affinity_key=key)
        )
        text = lambda c: self.tok.decode(c.output_ids, skip_special_tokens=True)  # noqa: E731
        reward = await self.reward(self._score, text(first), text(second), answer)
        row = trajectory_row(prompt_ids, [
            (first.output_ids, first.output_logprobs, first.output_versions),  # trained on
            (check, None, None),                                              # not trained on
            (second.output_ids, second.output_logprobs, second.output_versions),
        ])
        return row, reward

    async def arun_episode(self, engine, item):
        import asyncio

        prompt = self.tok.apply_chat_template([{"role": "user", "content": item["prompt"]}],
                                              add_generation_prompt=True, tokenize=False)
        prompt_ids = self.tok.encode(prompt, add_special_tokens=False)
        gid = new_group_id()
        samples = await asyncio.gather(*(self._sample(engine, prompt_ids, item["answer"], f"g{gid}")
                                         for _ in range(self.n)))
        rows, rewards = zip(*samples)
        return pad_and_stack(list(rows), {
            "rewards": torch.tensor(rewards, dtype=torch.float32),
            "group_id": torch.full((self.n,), gid, dtype=torch.int64),
        })


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--addr", help="host:port of a running server (default: start the embedded one)")
    ap.add_argument("--model-path", help="model directory (default: build the tiny model)")
    args = ap.parse_args()

    from arealite.engine.sglang_remote import RemoteSGLangEngine
    from arealite.rollout.controller import RolloutController

    model = args.model_path
    if model is None:
        from arealite.models.tiny import build_tiny_model

        model = str(build_tiny_model(tempfile.mkdtemp(), size="small", seed=0))
    server = None
    addr = args.addr
    if addr is None:
        from arealite.server.process import ServerProcess
        from tests.conftest import free_port

        server = ServerProcess(model, free_port(), threads=1).wait_healthy(120)
        addr = server.url
    try:
        rc = RolloutConfig(consumer_batch_size=2)
        with RolloutController(RemoteSGLangEngine([addr], rc), rc) as ctl:
            wf = AnswerThenCheck(AutoTokenizer.from_pretrained(model))
            batch = ctl.rollout_batch([{"prompt": "What is 2 + 3?", "answer": 5},
                                       {"prompt": "What is 7 - 4?", "answer": 3}], wf)
            print(batch)
            print("rewards:", batch["rewards"].tolist())
            print("trained tokens per row:", batch["loss_mask"].sum(1).tolist())
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
