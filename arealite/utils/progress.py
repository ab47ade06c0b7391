"""A progress bar for training steps that shows the numbers people watch."""

from __future__ import annotations

import sys
from typing import Any, Mapping

_SHOWN = (
    ("rollout/reward_mean", "reward", "{:.3f}"),
    ("eval/accuracy", "eval_acc", "{:.1%}"),
    ("rollout/staleness_mean", "stale", "{:.2f}"),
    ("time/step_s", "s/step", "{:.2f}"),
)


class Progress:
    """tqdm over training steps (rank 0); a plain line per step when stderr is not a terminal."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True):
        self.enabled = enabled
        self.total = total
        self._last_eval: float | None = None
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="RL steps", unit="step",
                             dynamic_ncols=True, file=sys.stderr, mininterval=0.5)

    def update(self, step: int, stats: Mapping[str, Any]) -> None:
        if not self.enabled or self._bar is None:
            return
        if "eval/accuracy" in stats:
            self._last_eval = float(stats["eval/accuracy"])
        shown = {}
        for key, label, fmt in _SHOWN:
            v = self._last_eval if key == "eval/accuracy" else stats.get(key)
            if isinstance(v, (int, float)):
                shown[label] = fmt.format(v)
        self._bar.set_postfix(shown, refresh=False)
        self._bar.update(step - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
