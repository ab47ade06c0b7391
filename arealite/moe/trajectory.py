"""The ``routed_experts`` trajectory key: the server's MoE routing, laid out like ``logprobs``.

Position t of a row holds the experts the server routed token t-1 to (per MoE layer, top-k
ids, flattened: ``[n_layers * top_k]``), i.e. the routing of the forward that scored token
t, as ``logprobs[t]`` is the log-prob of token t. Position 0 and padding hold -1. After
packing (`arealite.train_engine.packing`, which shifts per-token keys by one) position t
then holds token t's own routing.

Both sides of that layout are here: the workflows write the key (`routed_experts_of`,
`conversation_routed_experts`; the agent workflow `place_routed_experts` of its recorded calls),
the train engine reads it back from a packed micro-batch and replays it in the forward
(`replay_routing`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from arealite.api.types import Completion
from arealite.moe.router_hooks import RoutingReplay, moe_routers

__all__ = ["ROUTED_EXPERTS_KEY", "conversation_routed_experts", "kept_routed_experts", "micro_batch_experts",
           "place_routed_experts", "replay_routing", "routed_experts_of"]

#: The trajectory key holding the server's routing (``[B, L, n_moe_layers * top_k]``, int16/int32;
#: position t: the experts routed at token t-1, the forward that scored token t; -1: none).
ROUTED_EXPERTS_KEY = "routed_experts"


def _checked_rows(c: Completion) -> torch.Tensor | None:
    """``c.routed_experts`` after checking it covers every token ``c`` ran forward."""
    rows = c.routed_experts
    ran = len(c.input_ids) + len(c.output_ids) - 1
    if rows is not None and (rows.dim() != 2 or rows.shape[0] != ran):
        raise ValueError(f"completion {c.rid}: routed_experts has shape {tuple(rows.shape)}, expected "
                         f"[{ran}, n_layers * top_k] (prompt + output - 1 tokens)")
    return rows


def routed_experts_of(comps: Sequence[Completion], width: int) -> torch.Tensor | None:
    """``[n, width, n_layers * top_k]`` int16 for the single-turn samples ``comps`` (prompt + output,
    right-padded to ``width``); None when any sample has no routing (the server was not asked)."""
    if any(c.routed_experts is None for c in comps):  # not an MoE run: nothing built per trajectory
        return None
    return conversation_routed_experts([[c] for c in comps], [len(c.input_ids) + len(c.output_ids) for c in comps],
                                       width)


def conversation_routed_experts(turns: Sequence[Sequence[Completion]], lengths: Sequence[int],
                                width: int) -> torch.Tensor | None:
    """``[n, width, n_layers * top_k]`` int16 for n multi-turn rows; None when a turn has no routing.

    Row i is a conversation of ``lengths[i]`` tokens whose model turns are ``turns[i]``, in order;
    each turn's request held the whole conversation so far. Token j takes its routing from the
    first turn that ran it forward (the turn that generated it, or for a turn's last token and
    the environment's tokens, the next turn's prefill), as an interrupted request keeps each row
    from the segment that first ran it: the routing that produced the behaviour log-prob.
    """
    return place_routed_experts([[_checked_rows(c) for c in row] for row in turns], lengths, width)


def place_routed_experts(turns: Sequence[Sequence[torch.Tensor | None]], lengths: Sequence[int],
                         width: int) -> torch.Tensor | None:
    """`conversation_routed_experts` of turns given by their routing alone (the agent's calls).

    ``turns[i]`` holds, in order, the routing each model turn of row i reported:
    ``[ran, n_layers * top_k]``, one row per token of the conversation's first ``ran + 1`` the
    turn ran forward. None when a row has no turn or a turn has no routing.
    """
    if not turns or any(not row or any(rows is None for rows in row) for row in turns):
        return None
    per_token = turns[0][0].shape[1]
    out = torch.full((len(turns), width, per_token), -1, dtype=torch.int16)
    for i, (row, n) in enumerate(zip(turns, lengths)):
        done = 0  # tokens of row i whose routing is placed
        for k, rows in enumerate(row):
            ran = rows.shape[0]
            if rows.dim() != 2 or rows.shape[1] != per_token or ran > n - 1:
                raise ValueError(f"row {i}, turn {k}: routed_experts has shape {tuple(rows.shape)}, expected "
                                 f"[at most {n - 1}, {per_token}] within a conversation of {n} tokens")
            if ran > done:
                out[i, 1 + done:1 + ran] = rows[done:ran].to(torch.int16)
                done = ran
        if done != n - 1:
            raise ValueError(f"conversation {i}: routing covers {done} of its {n - 1} forwarded tokens; "
                             "its last model turn must end the row")
    return out


def kept_routed_experts(comp: Completion, n_output: int) -> torch.Tensor | None:
    """The routing of ``comp``'s prompt and first ``n_output`` output tokens, ``[len(input_ids) +
    n_output - 1, n_layers * top_k]``: a reply cut short (at a stop string) keeps the rows of the
    tokens it keeps, as if generation had stopped there. None: the server was not asked."""
    rows = _checked_rows(comp)
    return None if rows is None else rows[:len(comp.input_ids) + n_output - 1]


def micro_batch_experts(mb: dict[str, torch.Tensor], top_k: int) -> torch.Tensor | None:
    """The replay tensor ``[T, n_layers, k]`` of a packed micro-batch, or None when it carries no routing.

    Packing shifts per-token keys by one (position t holds token t+1's value), and the
    trajectory stores at t+1 the routing of token t (see `ROUTED_EXPERTS_KEY`), so after
    packing position t holds exactly token t's routing. The last token of each sequence got
    zeros from the shift: it has no server routing and keeps its own (-1).
    """
    flat = mb.get(ROUTED_EXPERTS_KEY)
    if flat is None:
        return None
    if flat.dim() != 2 or flat.shape[1] % top_k:
        raise ValueError(f"routed_experts of a micro-batch has shape {tuple(flat.shape)}; expected "
                         f"[T, n_layers * {top_k}] (the trajectory key is [B, L, n_layers * top_k])")
    experts = flat.reshape(flat.shape[0], -1, top_k).to(torch.int64).clone()
    last = mb["cu_seqlens"][1:].to(torch.int64) - 1
    experts[last] = -1
    return experts


@contextmanager
def replay_routing(model: torch.nn.Module, mb: dict[str, torch.Tensor] | None,
                   local: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Iterator[None]:
    """Replay the micro-batch's server routing in the forwards inside (nothing when it carries
    none); ``local`` picks the rows of the tokens this rank's forward runs (sequence parallelism:
    its share of the micro-batch, padding routed by the router's own choice)."""
    routers = moe_routers(model) if mb is not None and ROUTED_EXPERTS_KEY in mb else []
    experts = micro_batch_experts(mb, int(routers[0].top_k)) if routers else None
    if experts is not None and local is not None:
        experts = local(experts)
    if experts is None:
        yield
        return
    with RoutingReplay(model, experts, routers):  # the routers found above: one walk of the model
        yield
