"""The ``routed_experts`` trajectory key: the server's MoE routing, laid out like ``logprobs``.

Position t of a row holds the experts the server routed token t-1 to (per MoE layer, top-k
ids, flattened: ``[n_layers * top_k]``), i.e. the routing of the forward that scored token
t, as ``logprobs[t]`` is the log-prob of token t. Position 0 and padding hold -1. After
packing (`arealite.train_engine.packing`, which shifts per-token keys by one) position t
then holds token t's own routing, which `arealite.train_engine.routing_replay` replays.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from arealite.api.types import Completion
from arealite.train_engine.routing_replay import ROUTED_EXPERTS_KEY

__all__ = ["ROUTED_EXPERTS_KEY", "conversation_routed_experts", "routed_experts_of"]


def routed_experts_of(comps: Sequence[Completion], width: int) -> torch.Tensor | None:
    """``[n, width, n_layers * top_k]`` int16 for the single-turn samples ``comps`` (prompt + output,
    right-padded to ``width``); None when any sample has no routing (the server was not asked)."""
    if not comps or any(c.routed_experts is None for c in comps):
        return None
    per_token = comps[0].routed_experts.shape[1]
    out = torch.full((len(comps), width, per_token), -1, dtype=torch.int16)
    for i, c in enumerate(comps):
        rows = c.routed_experts
        n = len(c.input_ids) + len(c.output_ids)
        if rows.shape != (n - 1, per_token):
            raise ValueError(f"completion {c.rid}: routed_experts has shape {tuple(rows.shape)}, expected "
                             f"[{n - 1}, {per_token}] (prompt + output - 1 tokens)")
        out[i, 1:n] = rows.to(torch.int16)
    return out


def conversation_routed_experts(turns: Sequence[Sequence[Completion]], lengths: Sequence[int],
                                width: int) -> torch.Tensor | None:
    """``[n, width, n_layers * top_k]`` int16 for n multi-turn rows; None when a turn has no routing.

    Row i is a conversation of ``lengths[i]`` tokens whose model turns are ``turns[i]``, in order;
    each turn's request held the whole conversation so far. Token j takes its routing from the
    first turn that ran it forward (the turn that generated it, or for a turn's last token and
    the environment's tokens, the next turn's prefill), as an interrupted request keeps each row
    from the segment that first ran it: the routing that produced the behaviour log-prob.
    """
    if not turns or any(not row or any(c.routed_experts is None for c in row) for row in turns):
        return None
    per_token = turns[0][0].routed_experts.shape[1]
    out = torch.full((len(turns), width, per_token), -1, dtype=torch.int16)
    for i, (row, n) in enumerate(zip(turns, lengths)):
        done = 0  # tokens of row i whose routing is placed
        for c in row:
            rows = c.routed_experts
            ran = len(c.input_ids) + len(c.output_ids) - 1
            if rows.shape != (ran, per_token) or ran > n - 1:
                raise ValueError(f"completion {c.rid}: routed_experts has shape {tuple(rows.shape)}, expected "
                                 f"[{ran}, {per_token}] within a conversation of {n} tokens")
            if ran > done:
                out[i, 1 + done:1 + ran] = rows[done:ran].to(torch.int16)
                done = ran
        if done != n - 1:
            raise ValueError(f"conversation {i}: routing covers {done} of its {n - 1} forwarded tokens; "
                             "its last model turn must end the row")
    return out
