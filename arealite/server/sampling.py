"""Sampling the next token of a batch, as SGLang does (the requests are parsed in
`arealite.server.generate_request`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

GREEDY_EPS = 1e-6  # SGLang: a temperature below this is greedy decoding


@dataclass
class SamplingConfig:
    """The sampling parameters of one request, validated."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


# --------------------------------------------------------------------------
# The batched sampler.
# --------------------------------------------------------------------------


@dataclass
class BatchSamplingState:
    """Per-row sampling parameters of the running batch, as tensors.

    Rebuilt only when the batch changes, so a decode step stays a few tensor ops.
    """

    temperature: torch.Tensor  # [B] (1.0 for greedy rows: the log-prob is then at T=1)
    greedy: torch.Tensor  # [B] bool
    top_p: torch.Tensor
    top_k: torch.Tensor  # [B] int64, vocab size for "all"
    min_p: torch.Tensor
    all_greedy: bool
    any_filter: bool
    generators: list[torch.Generator | None] = field(default_factory=list)

    @classmethod
    def build(cls, configs: list[SamplingConfig], generators: list[torch.Generator | None], vocab: int,
              device: torch.device) -> "BatchSamplingState":
        greedy = [c.greedy for c in configs]
        temps = [1.0 if g else c.temperature for c, g in zip(configs, greedy)]
        top_k = [vocab if c.top_k <= 0 else min(c.top_k, vocab) for c in configs]
        any_filter = any(
            (not g) and (c.top_p < 1.0 or c.top_k > 0 or c.min_p > 0) for c, g in zip(configs, greedy)
        )
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_p=torch.tensor([c.top_p for c in configs], dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            min_p=torch.tensor([c.min_p for c in configs], dtype=torch.float32, device=device),
            all_greedy=all(greedy),
            any_filter=any_filter,
            generators=list(generators),
        )


def filter_probs(probs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens outside top-k, the top-p nucleus and the min-p floor (SGLang's order).

    The result is not renormalised: the exponential race below does not need it.
    """
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    cum = sorted_p.cumsum(dim=-1)
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    # A token is dropped when the mass before it already reaches top_p (so the
    # most likely token always survives).
    drop = (cum - sorted_p) > top_p[:, None]
    drop |= ranks[None, :] >= top_k[:, None]
    drop |= sorted_p < (sorted_p[:, :1] * min_p[:, None])
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, idx, sorted_p)


def sample_next(
    logits: torch.Tensor, state: BatchSamplingState, shared_gen: torch.Generator, top: int = 0,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Pick the next token of every row; return (tokens [B], log-probs [B]) and, when
    ``top`` > 0, the ``top`` most likely tokens' (log-probs, ids) [B, top] as a third item.

    The log-prob is SGLang's: ``log_softmax(logits / T)`` over the full
    vocabulary in fp32, before any top-p/top-k truncation (T = 1 for greedy);
    the top log-probs come from the same distribution.
    """
    tokens, logp = _sample(logits, state, shared_gen)
    chosen = logp.gather(-1, tokens[:, None])[:, 0]
    if top > 0:
        values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
        return tokens, chosen, (values, ids)
    return tokens, chosen


def sample_rows(logits: torch.Tensor, state: BatchSamplingState, shared_gen: torch.Generator, top: int):
    """`sample_next` with the ``top`` log-probs as lists (None when ``top`` is 0), as the runner keeps them."""
    if top == 0:
        return (*sample_next(logits, state, shared_gen), None)
    tokens, logprobs, (values, ids) = sample_next(logits, state, shared_gen, top=top)
    return tokens, logprobs, (values.tolist(), ids.tolist())


def _sample(logits: torch.Tensor, state: BatchSamplingState,
            shared_gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], the full log-prob matrix [B, V])."""
    logits = logits.float()
    logp = torch.log_softmax(logits / state.temperature[:, None], dim=-1)
    if state.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        probs = logp.exp()
        if state.any_filter:
            probs = filter_probs(probs, state.top_p, state.top_k, state.min_p)
        # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) is a draw from p.
        # Rows with their own seed draw from their own generator, so their
        # samples do not depend on what else is in the batch.
        noise = torch.empty_like(probs)
        gens = state.generators
        shared_rows = [i for i, g in enumerate(gens) if g is None]
        if len(shared_rows) == len(gens):
            noise.exponential_(generator=shared_gen)
        else:
            for i, g in enumerate(gens):
                noise[i].exponential_(generator=g if g is not None else shared_gen)
        tokens = (probs / noise).argmax(dim=-1)
        tokens = torch.where(state.greedy, logits.argmax(dim=-1), tokens)
    return tokens, logp
