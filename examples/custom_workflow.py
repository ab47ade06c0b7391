"""A user-written workflow in one page: "answer, then check your own answer".

The model answers a question; the workflow then asks it, in the same
conversation, to restate only the final answer. Both turns are scored with the
run's reward function (``data.reward_fn``): the trajectory gets 1.0 if the
answer and the restatement are right, 0.5 if only the answer is, else 0. The
conversation is kept as token ids (token-in/token-out) and the turns are
rendered with the tokenizer's chat template; only the model's own tokens are
trained on.

Train with it by naming it in the config (run from the repository root, or put
this file's directory on PYTHONPATH), its settings in ``rollout.workflow_kwargs``:

    rollout:
      workflow: examples.custom_workflow:AnswerThenCheck
      workflow_kwargs: {check_prompt: "Only the number, please."}

Or try it alone against the embedded server on the tiny model (no GPU needed):

    python examples/custom_workflow.py
or against a running server:

    python examples/custom_workflow.py --addr 127.0.0.1:30000 --model-path MODEL_DIR
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from typing import Any

import torch

from arealite.api.types import GenerationRequest
from arealite.config.schema import GenerationConfig, RolloutConfig
from arealite.workflow.base import RolloutWorkflow, new_group_id, pad_and_stack, trajectory_row
from arealite.workflow.common import RewardScorer, item_fields, sampling_from_config, user_turn_piece


class AnswerThenCheck(RolloutWorkflow):
    """Two model turns per sample, ``generation.n_samples`` samples per prompt (one GRPO group)."""

    def __init__(self, *, tokenizer: Any, generation: GenerationConfig, rollout: RolloutConfig, reward_fn: Any,
                 check_prompt: str = "Restate only the final answer."):
        self.tok = tokenizer
        self.n = generation.n_samples
        self.sampling = sampling_from_config(generation, tokenizer)  # EOS always stops
        # Scoring runs off the event loop, with rollout.reward_timeout_s and rollout.on_reward_error.
        self.scorer = RewardScorer(reward_fn, rollout)
        self.check_prompt = check_prompt

    def stats(self) -> dict[str, int]:
        return self.scorer.stats()

    async def _score(self, prompt: str, ids: list[int], out: list[int], fields: dict) -> float | None:
        return await self.scorer(prompt, self.tok.decode(out, skip_special_tokens=True), ids, out, fields)

    async def _sample(self, client, prompt: str, prompt_ids: list[int], fields: dict, key: str):
        first = await client.agenerate(GenerationRequest(prompt_ids, self.sampling, affinity_key=key))
        # Close the assistant turn, ask the check question, open the next assistant turn.
        check = user_turn_piece(self.tok, self.check_prompt, after=first.output_ids)
        context = prompt_ids + first.output_ids + check
        second = await client.agenerate(GenerationRequest(context, self.sampling, affinity_key=key))
        r1 = await self._score(prompt, prompt_ids, first.output_ids, fields)
        r2 = await self._score(prompt, context, second.output_ids, fields)
        row = trajectory_row(prompt_ids, [
            (first.output_ids, first.output_logprobs, first.output_versions),    # trained on
            (check, None, None),                                                # not trained on
            (second.output_ids, second.output_logprobs, second.output_versions),
        ])
        return row, None if r1 is None or r2 is None else r1 * (0.5 + 0.5 * r2)

    async def arun_episode(self, client, item):
        prompt = self.tok.apply_chat_template([{"role": "user", "content": item["prompt"]}],
                                              add_generation_prompt=True, tokenize=False)
        prompt_ids = self.tok.encode(prompt, add_special_tokens=False)
        gid = new_group_id()
        samples = await asyncio.gather(*(self._sample(client, prompt, prompt_ids, item_fields(item), f"g{gid}")
                                         for _ in range(self.n)))
        rows, rewards = zip(*samples)
        if None in rewards:  # a reward call failed and rollout.on_reward_error is `reject`
            return None
        return pad_and_stack(list(rows), {
            "rewards": torch.tensor(rewards, dtype=torch.float32),
            "group_id": torch.full((self.n,), gid, dtype=torch.int64),
        })


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--addr", help="host:port of a running server (default: start the embedded one)")
    ap.add_argument("--model-path", help="model directory (default: build the tiny model)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from arealite.inference_client.sglang_client import SGLangClient
    from arealite.reward.math import math_reward
    from arealite.rollout.controller import RolloutController

    model = args.model_path
    if model is None:
        from arealite.models.tiny import build_tiny_model

        model = str(build_tiny_model(tempfile.mkdtemp(), size="small", seed=0))
    server = None
    addr = args.addr
    if addr is None:
        from arealite.server.process import ServerProcess
        from arealite.utils.net import free_port

        server = ServerProcess(model, free_port(), threads=1).wait_healthy(120)
        addr = server.url
    try:
        rc = RolloutConfig(consumer_batch_size=2)
        wf = AnswerThenCheck(tokenizer=AutoTokenizer.from_pretrained(model),
                             generation=GenerationConfig(n_samples=2, max_new_tokens=16), rollout=rc,
                             reward_fn=math_reward)
        with RolloutController(SGLangClient([addr], rc), rc) as ctl:
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
