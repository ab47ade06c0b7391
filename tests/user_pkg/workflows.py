"""Workflows a user writes in their own package (tests name them as `user_pkg.workflows:Name`)."""

from __future__ import annotations

from arealite.workflow.base import RolloutWorkflow


class NeedsPieces(RolloutWorkflow):
    """Asks for some of the run's pieces by parameter name, plus two options of its own."""

    def __init__(self, tokenizer, generation, *, bonus: float, tag: str = "x"):
        self.tokenizer, self.generation, self.bonus, self.tag = tokenizer, generation, bonus, tag

    async def arun_episode(self, client, item):
        return None


class FromConfig(RolloutWorkflow):
    """Built by its own classmethod."""

    def __init__(self, cfg, tokenizer, scale):
        self.cfg, self.tokenizer, self.scale = cfg, tokenizer, scale

    @classmethod
    def from_config(cls, cfg, tokenizer, scale: int = 1):
        return cls(cfg, tokenizer, scale)

    async def arun_episode(self, client, item):
        return None


class NotAWorkflow:
    """No arun_episode."""
