"""The log-prob probe: after each push, the servers and the trainer score the same tokens.

Reading weights back works only for some model classes on SGLang (``/get_weights_by_name``
answers 400 for Qwen2, for example), so a check that works on every model compares what
matters: log-probs. Before the transfer every trainer rank runs its own forward of a
fixed token sequence (``prepare``; a collective on a sharded engine); once the servers
generate again, each scores the same sequence (``/generate`` with ``logprob_start_len: 0``
and ``return_logprob``, one new token) and must

- report the new weight version for it (the update was applied), and
- agree with the trainer: the mean absolute log-prob difference is at most
  ``tolerance`` (by default 1e-3 for float32 servers, 5e-2 for 16-bit ones).

The figures are logged every step as the train/inference mismatch:
``probe_mean_abs_diff``, ``probe_max_abs_diff`` and ``probe_k3`` (the mean of
``exp(d) - 1 - d`` with ``d = server - trainer`` log-prob, the k3 estimator of
KL(trainer || server) on the probe's tokens), the worst over the servers.

It costs a forward on each side (on a CPU, about one read of every weight);
``weight_sync.probe_every`` spreads it over several versions.

For a vision-language model the probe is the first training prompt whole, with its images
(``image_data``, base64 as requests carry them; the trainer's scorer holds the same images
as tensors), so the vision tower's weights are checked too.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from arealite.api.contracts import WeightSource
from arealite.weight_sync.base import AdminCall, WeightSyncError

__all__ = ["LogprobProbe", "PromptScorer", "default_probe_tolerance", "probe_tokens"]

Scorer = Callable[[list[int]], list[float]]


class PromptScorer(Protocol):
    """Servers that score a prompt: ``{addr: (log-probs of ids[1:], weight version)}``."""

    async def score_prompt(self, input_ids: Sequence[int], image_data: Sequence[str] | None = None
                           ) -> dict[str, tuple[list[float], int | None]]: ...

    @property
    def healthy_servers(self) -> list[str]: ...


def default_probe_tolerance(server_dtype: torch.dtype | None) -> float:
    """Mean absolute log-prob difference allowed between a server and the trainer."""
    return 5e-2 if server_dtype in (torch.bfloat16, torch.float16) else 1e-3


def probe_tokens(prompt: Sequence[int] | None, vocab_size: int, n: int, seed: int = 0) -> list[int]:
    """The probe's tokens: a real prompt's first ``n`` (padded with seeded ids when shorter)."""
    ids = [int(t) for t in (prompt or [])][:n]
    rng = random.Random(seed)
    while len(ids) < max(n, 2):
        ids.append(rng.randrange(vocab_size))
    return ids


def mismatch(server: Sequence[float], trainer: Sequence[float]) -> dict[str, float]:
    """Mean/max absolute difference and k3 between two log-prob sequences of one token list."""
    s = torch.tensor(list(server), dtype=torch.float64)
    t = torch.tensor(list(trainer), dtype=torch.float64)
    d = s - t
    return {"probe_mean_abs_diff": float(d.abs().mean()), "probe_max_abs_diff": float(d.abs().max()),
            "probe_k3": float((d.clamp(max=20).exp() - 1 - d).mean())}


class LogprobProbe:
    """`WeightVerifier` by log-probs (see the module's docstring).

    ``score`` is the trainer's forward (every rank calls it, in step); ``servers`` scores
    the tokens on every server in rotation; ``tolerance`` may be a callable (the servers'
    dtype is known only once the transfer has started). ``image_data``: the images of the
    tokens' placeholders (the servers get them; ``score`` must already hold them).
    """

    def __init__(self, servers: PromptScorer, score: Scorer, tokens: list[int],
                 tolerance: float | Callable[[], float], every: int = 1, image_data: Sequence[str] = ()):
        if len(tokens) < 2:
            raise ValueError(f"the probe needs at least 2 tokens, got {len(tokens)}")
        if every < 1:
            raise ValueError(f"every={every} must be >= 1 (weight_sync.probe_every)")
        self.servers, self.score, self.tokens, self.every = servers, score, list(tokens), int(every)
        self.image_data = list(image_data)
        self._tolerance = tolerance
        self._expected: list[float] | None = None

    @property
    def tolerance(self) -> float:
        return float(self._tolerance() if callable(self._tolerance) else self._tolerance)

    def _due(self, version: int) -> bool:
        return version % self.every == 0

    def prepare(self, version: int) -> None:
        if not self._due(version):
            return
        expected = [float(x) for x in self.score(self.tokens)]
        if len(expected) != len(self.tokens) - 1 or not all(map(math.isfinite, expected)):
            raise WeightSyncError(f"the trainer's probe forward gave {len(expected)} log-probs "
                                  f"(non-finite: {sum(not math.isfinite(x) for x in expected)}) "
                                  f"for {len(self.tokens)} tokens", version=version)
        self._expected = expected

    def observe(self, source: WeightSource, version: int) -> WeightSource:
        return source

    def verify(self, version: int, call: AdminCall) -> dict[str, float]:
        return {}

    def check_serving(self, version: int, call: AdminCall) -> dict[str, float]:
        expected, self._expected = self._expected, None
        if not self._due(version):
            return {}
        if expected is None:
            raise RuntimeError("LogprobProbe.check_serving before prepare(version)")
        images = {"image_data": self.image_data} if self.image_data else {}
        answers = call(lambda: self.servers.score_prompt(self.tokens, **images), "the log-prob probe")
        tol, worst = self.tolerance, {}
        for addr, (logprobs, served) in sorted(answers.items()):
            if served != version:
                raise WeightSyncError(f"the log-prob probe ran on weight version {served}, not the "
                                      "version just pushed (the update did not take)",
                                      server=addr, version=version)
            m = mismatch(logprobs, expected)
            if not m["probe_mean_abs_diff"] <= tol:
                raise WeightSyncError(
                    f"log-prob probe mismatch: mean |server - trainer| = {m['probe_mean_abs_diff']:.3g} "
                    f"over {len(expected)} tokens (max {m['probe_max_abs_diff']:.3g}) exceeds "
                    f"weight_sync.probe_tolerance={tol:g}; the server does not hold the trainer's weights",
                    server=addr, version=version)
            worst = {k: max(v, worst.get(k, -math.inf)) for k, v in m.items()}
        return worst
