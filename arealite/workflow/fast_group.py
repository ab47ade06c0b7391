"""The fast path behind ``group_from_outputs``: a single-turn group built from flat buffers.

It builds the same TensorDict as ``pad_and_stack`` over one ``trajectory_row`` per
sample (tests/test_workflows.py holds the two equal), but writes all n rows of each
key into one Python ``array`` and wraps it with ``torch.frombuffer``: no per-row
tensors, no padding copies. It then skips what cannot fail by construction: the
TensorDict constructor's shape checks and the validator's per-token checks
(``mark_well_formed``). On bench_workflow_cpu's RLVR run (n=1, 200-token prompts),
the plain path instead costs 82-114 us more loop CPU per trajectory, 1.9x in all
(both interleaved in one process, medians of 10 and of 30 rounds).
"""

from __future__ import annotations

from array import array
from typing import Sequence

import torch
from tensordict import TensorDict

from arealite.api.types import mark_well_formed

#: ``(ids, logprobs, versions)`` of one generated sample.
Output = tuple[Sequence[int], Sequence[float], Sequence[int]]

_MINUS_ONE = array("q", [-1])
_ONE = b"\1"


def single_turn_group(prompt_ids: Sequence[int], outputs: Sequence[Output], per_row: dict[str, torch.Tensor]) -> TensorDict:
    """The ``[n, L]`` group of ``prompt + output_i``, right-padded (see ``group_from_outputs``)."""
    n, P = len(outputs), len(prompt_ids)
    if n == 1:
        return _one_sample(prompt_ids, outputs[0], per_row)
    if n == 0:
        raise ValueError("group_from_outputs needs at least one output")
    lens = [len(o[0]) for o in outputs]
    G = max(lens)
    L = P + G
    prompt = array("q", prompt_ids)
    ids, vers, lps = array("q"), array("q"), array("f")
    prompt_vers, prompt_lps = _MINUS_ONE * P, array("f", bytes(4 * P))
    loss = bytearray()
    for (o_ids, o_lps, o_vers), g in zip(outputs, lens):
        _check_piece(g, o_lps, o_vers)
        pad = G - g
        ids += prompt
        ids.extend(o_ids)
        vers += prompt_vers
        vers.extend(o_vers)
        lps += prompt_lps
        lps.extend(o_lps)
        loss += b"\0" * P + _ONE * g + b"\0" * pad
        if pad:
            ids.extend(bytes(pad))  # zeros
            vers.extend([-1] * pad)
            lps.extend(bytes(pad))
    if L == 0:
        raise ValueError("group_from_outputs: empty prompt and empty outputs give no tokens")
    shape = (n, L)
    if G == min(lens):
        attention = torch.ones(shape, dtype=torch.bool)
    else:
        attention = torch.frombuffer(
            bytearray(b"".join(_ONE * (P + g) + b"\0" * (G - g) for g in lens)), dtype=torch.bool
        ).view(shape)
    return _vouched_group(
        torch.frombuffer(ids, dtype=torch.int64).view(shape),
        attention,
        torch.frombuffer(loss, dtype=torch.bool).view(shape),
        torch.frombuffer(lps, dtype=torch.float32).view(shape),
        torch.frombuffer(vers, dtype=torch.int64).view(shape),
        per_row,
        n,
    )


def _one_sample(prompt_ids: Sequence[int], output: Output, per_row: dict[str, torch.Tensor]) -> TensorDict:
    # One sample (the common evaluation and n=1 case): no padding, no per-sample loop.
    o_ids, o_lps, o_vers = output
    P, g = len(prompt_ids), len(o_ids)
    _check_piece(g, o_lps, o_vers)
    L = P + g
    if L == 0:
        raise ValueError("group_from_outputs: empty prompt and empty outputs give no tokens")
    ids = array("q", prompt_ids)
    ids.extend(o_ids)
    vers = _MINUS_ONE * P
    vers.extend(o_vers)
    lps = array("f", bytes(4 * P))
    lps.extend(o_lps)
    return _vouched_group(
        torch.frombuffer(ids, dtype=torch.int64)[None],
        torch.frombuffer(bytearray(_ONE * L), dtype=torch.bool)[None],
        torch.frombuffer(bytearray(P) + _ONE * g, dtype=torch.bool)[None],
        torch.frombuffer(lps, dtype=torch.float32)[None],
        torch.frombuffer(vers, dtype=torch.int64)[None],
        per_row,
        1,
    )


def _check_piece(n: int, lps: Sequence[float] | None, vers: Sequence[int] | None) -> None:
    if lps is None or len(lps) != n or vers is None or len(vers) != n:
        raise ValueError(
            f"generated piece has {n} tokens but {None if lps is None else len(lps)} logprobs and "
            f"{None if vers is None else len(vers)} versions; the client must return one of each per token"
        )


def _vouched_group(input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                   logprobs: torch.Tensor, versions: torch.Tensor, per_row: dict[str, torch.Tensor],
                   n: int) -> TensorDict:
    """The group's TensorDict, vouched for as well-formed per token (``mark_well_formed``)."""
    tensors = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
               "logprobs": logprobs, "versions": versions, **per_row}
    td = unchecked_tensordict(tensors, n)
    return mark_well_formed(td, (input_ids, attention_mask, loss_mask, logprobs, versions))


def unchecked_tensordict(tensors: dict[str, torch.Tensor], n: int) -> TensorDict:
    """``TensorDict(tensors, batch_size=[n])`` without the constructor's per-value checks.

    The tensors are ``[n, ...]`` by construction. tensordict offers the unchecked
    constructor only as the private ``_new_unsafe``, which saves ~8 us of loop CPU per
    trajectory (7-9%) on bench_workflow_cpu's RLVR run (with and without, interleaved in
    one process, medians of 10 and of 30 rounds). Where it is missing, the public one.
    """
    new_unsafe = getattr(TensorDict, "_new_unsafe", None)  # private-ok: no public unchecked constructor
    if new_unsafe is None:
        return TensorDict(tensors, batch_size=[n])
    return new_unsafe(tensors, batch_size=torch.Size([n]))
