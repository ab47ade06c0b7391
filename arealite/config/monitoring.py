"""What a run reports while it trains: periodic evaluation on held-out prompts
(`evaluation`) and stats logging (`stats`, `stats.wandb`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from arealite.config.section import Section


class EvaluationConfig(Section):
    freq_steps: int | None = Field(None, ge=1)
    """Greedy evaluation on `data.eval_path` every this many steps (None = only at start and end)."""
    max_prompts: int | None = Field(None, ge=1)
    """Evaluate on at most this many held-out prompts (None = all)."""
    max_new_tokens: int | None = Field(None, gt=0)
    """Token limit of evaluation samples (None = `generation.max_new_tokens`)."""
    n_samples: int = Field(1, ge=1)
    """Besides greedy accuracy: this many sampled answers per held-out prompt, scored as
    pass@k and mean@k (k = 1, 2, 4, ... up to `n_samples`); 1 = greedy only."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the `n_samples` evaluation answers."""


class WandbConfig(Section):
    mode: Literal["disabled", "online", "offline"] = "disabled"
    """W&B mode; disabled by default."""
    project: str = "arealite"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user)."""


class StatsConfig(Section):
    tensorboard: bool = False
    """Also write TensorBoard event files under the run directory."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases logging."""
    plot: bool = True
    """Write `reward_curve.png` under the run directory at the end."""
    progress_bar: bool = True
    """Show a progress bar with step, reward and accuracy."""
