"""The fast path behind ``group_from_outputs``: a single-turn group built from flat buffers.

It builds the same TensorDict as ``pad_and_stack`` over one ``trajectory_row`` per
sample (tests/test_workflows.py holds the two equal), but writes all n rows of each
key into one Python ``array`` and wraps it with ``torch.frombuffer``: no per-row
tensors, no padding copies. It then skips what cannot fail by construction: the
TensorDict constructor's shape checks and the validator's per-token checks
(``mark_well_formed``). On bench_workflow_cpu's RLVR run (n=1, 200-token prompts),
the plain path instead costs 82-114 us more loop CPU per trajectory, 1.9x in all
(both interleaved in one process, medians of 10 and of 30 rounds).

The controller goes one step further with `GroupBuffers`: a group stays in its buffers until
its batch is taken, and `batch_from_buffers` makes the whole batch's tensors at once. On
bench_controller that is 30-45 us less CPU per trajectory (the group's nine tensors, its
TensorDict, their ``torch.cat`` into the batch and their deallocation; docs/scale.md).
"""

from __future__ import annotations

import math
from array import array
from typing import Sequence

import torch
from tensordict import TensorDict

from arealite.api.types import PER_ROW_KEYS, TRAJECTORY_KEYS, TrajectoryError, mark_well_formed

#: ``(ids, logprobs, versions)`` of one generated sample.
Output = tuple[Sequence[int], Sequence[float], Sequence[int]]

_MINUS_ONE = array("q", [-1])
_ONE = b"\1"


class GroupBuffers:
    """A single-turn group's rows in Python buffers, made into tensors with the rest of its batch.

    The controller keeps a finished group this way until it is taken (`batch_from_buffers`
    builds the batch: one ``frombuffer`` per key for all its groups, not one per key per group
    and a ``torch.cat`` over them). Built by `RLVRWorkflow.arun_group`; `to_tensordict` gives the
    group's own TensorDict, the one ``group_from_outputs`` builds. Well-formed by construction:
    every generated piece carries one log-prob and one version per token.

    ``per_row``: per-row keys (``rewards``, ``group_id``, ...) as ``array('f')`` (float32),
    ``array('q')`` (int64) or ``bytearray`` (bool), one value per sample.
    """

    __slots__ = ("n", "prompt_len", "lens", "width", "ids", "versions", "logprobs", "per_row")

    def __init__(self, prompt_ids: Sequence[int], outputs: Sequence[Output],
                 per_row: dict[str, array | bytearray]):
        n, P = len(outputs), len(prompt_ids)
        if n == 0:
            raise ValueError("group_from_outputs needs at least one output")
        prompt = array("q", prompt_ids)
        ids, vers, lps = array("q"), array("q"), array("f")
        prompt_vers, prompt_lps = _MINUS_ONE * P, array("f", bytes(4 * P))
        lens = []
        for o_ids, o_lps, o_vers in outputs:
            g = len(o_ids)
            _check_piece(g, o_lps, o_vers)
            ids += prompt
            ids.extend(o_ids)
            vers += prompt_vers
            vers.extend(o_vers)
            lps += prompt_lps
            lps.extend(o_lps)
            lens.append(P + g)
        width = max(lens)
        if width == 0:
            raise ValueError("group_from_outputs: empty prompt and empty outputs give no tokens")
        for key, buf in per_row.items():
            if len(buf) != n or _dtype_of(buf) is None:
                raise ValueError(f"per-row key {key!r}: expected {n} values in an array('f'), array('q') or "
                                 f"bytearray, got {len(buf)} in a {type(buf).__name__}")
            if isinstance(buf, array) and buf.typecode == "f" and not all(map(math.isfinite, buf)):
                raise ValueError(f"per-row key {key!r} holds a non-finite value: {list(buf)}")
        self.n, self.prompt_len, self.lens, self.width = n, P, lens, width
        self.ids, self.versions, self.logprobs, self.per_row = ids, vers, lps, per_row

    def validate(self, where: str) -> None:
        """Raise `TrajectoryError` unless the group holds every per-row key a trajectory needs
        (the per-token ones it holds by construction)."""
        missing = [k for k in PER_ROW_KEYS if k not in self.per_row]
        if missing:
            raise TrajectoryError(f"{where}: missing key(s) {missing} (required: {sorted(TRAJECTORY_KEYS)})")

    def to_tensordict(self) -> TensorDict:
        """The group's own ``[n, L]`` TensorDict (L its longest row), vouched well-formed."""
        return batch_from_buffers([self])


def _dtype_of(buf: array | bytearray) -> torch.dtype | None:
    if isinstance(buf, bytearray):
        return torch.bool
    return _ARRAY_DTYPES.get(getattr(buf, "typecode", ""))


_ARRAY_DTYPES = {"f": torch.float32, "q": torch.int64}


def batch_from_buffers(groups: Sequence[GroupBuffers], extra: dict[str, torch.Tensor] | None = None) -> TensorDict:
    """The groups' rows as one right-padded ``[B, L]`` batch (L the longest row), vouched for
    (``mark_well_formed``); ``extra``: more ``[B, ...]`` tensors to hold beside them."""
    keys = groups[0].per_row.keys()
    for i, g in enumerate(groups[1:], 1):
        if g.per_row.keys() != keys:
            raise ValueError(f"trajectory {i} has keys {sorted(g.per_row)}, trajectory 0 has {sorted(keys)}; "
                             "all trajectories of one batch need the same keys")
    L = max(g.width for g in groups)
    B = sum(g.n for g in groups)
    ids, vers, lps = array("q"), array("q"), array("f")
    loss = bytearray()
    padded = any(length != L for g in groups for length in g.lens)
    attention = bytearray() if padded else None
    for g in groups:
        P = g.prompt_len
        if not padded:  # every row as wide as the batch (a fixed-length run): whole buffers
            ids += g.ids
            vers += g.versions
            lps += g.logprobs
            for length in g.lens:
                loss += bytes(P) + _ONE * (length - P)
            continue
        at = 0
        for length in g.lens:
            pad = L - length
            ids += g.ids[at:at + length]
            vers += g.versions[at:at + length]
            lps += g.logprobs[at:at + length]
            at += length
            loss += bytes(P) + _ONE * (length - P) + bytes(pad)
            attention += _ONE * length + bytes(pad)
            if pad:
                ids.extend(bytes(pad))  # zeros
                vers.extend([-1] * pad)
                lps.extend(bytes(pad))
    shape = (B, L)
    per_token = (
        torch.frombuffer(ids, dtype=torch.int64).view(shape),
        torch.ones(shape, dtype=torch.bool) if attention is None else torch.frombuffer(attention, dtype=torch.bool).view(shape),
        torch.frombuffer(loss, dtype=torch.bool).view(shape),
        torch.frombuffer(lps, dtype=torch.float32).view(shape),
        torch.frombuffer(vers, dtype=torch.int64).view(shape),
    )
    tensors = dict(zip(("input_ids", "attention_mask", "loss_mask", "logprobs", "versions"), per_token))
    for key in keys:
        first = groups[0].per_row[key]
        buf = type(first)() if isinstance(first, bytearray) else array(first.typecode)
        for g in groups:
            buf += g.per_row[key]
        tensors[key] = torch.frombuffer(buf, dtype=_dtype_of(first))
    if extra:
        tensors.update(extra)
    return mark_well_formed(unchecked_tensordict(tensors, B), per_token)


def single_turn_group(prompt_ids: Sequence[int], outputs: Sequence[Output], per_row: dict[str, torch.Tensor]) -> TensorDict:
    """The ``[n, L]`` group of ``prompt + output_i``, right-padded (see ``group_from_outputs``)."""
    return batch_from_buffers([GroupBuffers(prompt_ids, outputs, {})], per_row)


def _check_piece(n: int, lps: Sequence[float] | None, vers: Sequence[int] | None) -> None:
    if lps is None or len(lps) != n or vers is None or len(vers) != n:
        raise ValueError(
            f"generated piece has {n} tokens but {None if lps is None else len(lps)} logprobs and "
            f"{None if vers is None else len(vers)} versions; the client must return one of each per token"
        )


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
