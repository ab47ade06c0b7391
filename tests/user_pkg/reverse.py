"""A user's whole RL task in one module, outside the arealite package: a workflow, an
advantage estimator and a policy loss, each named in a YAML config by `module:name`.

Every call leaves a line in ``$USER_PKG_TRACE`` (when set), so a test can prove that the
trainer ran the user's code and not a built-in.
"""

from __future__ import annotations

import asyncio
import os

import torch

from arealite.api.types import GenerationRequest, SamplingParams
from arealite.workflow.base import RolloutWorkflow, group_from_outputs, new_group_id


def _trace(what: str) -> None:
    path = os.environ.get("USER_PKG_TRACE")
    if path:
        with open(path, "a") as f:
            f.write(f"{what} {os.environ.get('RANK', '-')}\n")


class ReverseWorkflow(RolloutWorkflow):
    """``reverse 123 =`` → n samples; reward 1 for exactly the reversed digits, plus a
    bonus for answers of the right length (so partially right answers still teach)."""

    def __init__(self, tokenizer, generation, *, length_bonus: float = 0.0):
        self.tokenizer, self.generation, self.length_bonus = tokenizer, generation, length_bonus

    def reward(self, digits: str, text: str) -> float:
        answer = text.strip().split(" ")[0] if text.strip() else ""
        if answer == digits[::-1]:
            return 1.0
        return self.length_bonus if len(answer) == len(digits) else 0.0

    async def arun_episode(self, client, item):
        _trace("workflow")
        g = self.generation
        prompt_ids = self.tokenizer.encode(item["prompt"], add_special_tokens=False)
        sampling = SamplingParams(max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                                  greedy=g.greedy, stop_token_ids=[self.tokenizer.eos_token_id])
        key = os.urandom(8).hex()
        outs = await asyncio.gather(*(client.agenerate(GenerationRequest(
            input_ids=prompt_ids, sampling=sampling, affinity_key=key)) for _ in range(g.n_samples)))
        digits = item["prompt"].split()[1]
        rewards = [self.reward(digits, self.tokenizer.decode(o.output_ids, skip_special_tokens=True))
                   for o in outs]
        n = len(outs)
        return group_from_outputs(
            prompt_ids, [(o.output_ids, o.output_logprobs, o.output_versions) for o in outs],
            {"rewards": torch.tensor(rewards, dtype=torch.float32),
             "group_id": torch.full((n,), new_group_id(), dtype=torch.int64)})


def centered_advantages(rewards: torch.Tensor, group_id: torch.Tensor) -> torch.Tensor:
    """Reward minus its group's mean, without GRPO's division by the std."""
    _trace("advantage")
    out = torch.empty_like(rewards)
    for g in group_id.unique():
        rows = group_id == g
        out[rows] = rewards[rows] - rewards[rows].mean()
    return out


def clipped_reinforce_loss(logp, prox_logp, advantages, loss_mask, behav_logp, config):
    """-A · min(ratio, 1 + eps) per token, the ratio against the proximal policy."""
    _trace("loss")
    ratio = torch.exp(logp - prox_logp).clamp(max=1.0 + config.eps_clip)
    mask = loss_mask.bool()
    token_loss = torch.where(mask, -advantages * ratio, torch.zeros_like(logp))
    return token_loss, {"user_ratio_mean": (ratio.detach() * mask).sum() / mask.sum().clamp(min=1)}
