"""Training progress that shows the numbers people watch: a tqdm bar on a terminal,
plain lines otherwise (under the launcher, whose log files and console echo are line-based)."""

from __future__ import annotations

import os
import sys
import time
from typing import Mapping

_SHOWN = (
    ("rollout/reward_mean", "reward", "{:.3f}"),
    ("eval/accuracy", "eval_acc", "{:.1%}"),
    ("rollout/staleness_mean", "stale", "{:.2f}"),
    ("time/step_s", "s/step", "{:.2f}"),
)


class Progress:
    """Progress of training steps on rank 0.

    On a terminal, a tqdm bar; otherwise one line about every 5% of the run (and on
    every evaluation), with the ETA. ``AREALITE_PROGRESS=lines|bar`` forces a style.
    """

    def __init__(self, total: int, initial: int = 0, enabled: bool = True):
        self.enabled = enabled
        self.total = total
        self.initial = initial
        self._last_eval: float | None = None
        self._bar = None
        self._t0 = time.monotonic()
        self._every = max(1, total // 20)
        style = os.environ.get("AREALITE_PROGRESS") or ("bar" if sys.stderr.isatty() else "lines")
        if enabled and style == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="RL steps", unit="step",
                             dynamic_ncols=True, file=sys.stderr, mininterval=0.5)

    def _fields(self, stats: Mapping[str, object]) -> dict[str, str]:
        if "eval/accuracy" in stats:
            self._last_eval = float(stats["eval/accuracy"])
        shown = {}
        for key, label, fmt in _SHOWN:
            v = self._last_eval if key == "eval/accuracy" else stats.get(key)
            if isinstance(v, (int, float)):
                shown[label] = fmt.format(v)
        return shown

    def update(self, step: int, stats: Mapping[str, object]) -> None:
        if not self.enabled:
            return
        shown = self._fields(stats)
        if self._bar is not None:
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(step - self._bar.n)
            return
        if step % self._every and step != self.total and "eval/accuracy" not in stats:
            return
        done = step - self.initial
        elapsed = time.monotonic() - self._t0
        eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
        pct = step / self.total if self.total else 1.0
        text = "  ".join(f"{k} {v}" for k, v in shown.items())
        print(f"[step {step}/{self.total} {pct:4.0%}] {text}  elapsed {elapsed:.0f}s  eta {eta:.0f}s",
              file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
