"""What a generation answer must satisfy before its tokens may reach a trajectory.

The client trusts no server: a buggy build, a proxy that rewrites bodies or a hostile
process on the port must not put an out-of-vocabulary id into an embedding lookup, a NaN
into an importance ratio or ten thousand tokens into a 64-token budget. Every segment is
checked here, whatever the backend; a violation is a malformed answer
(``AttemptFailure("malformed")``), retried on another server like a dropped connection.
"""

from __future__ import annotations

import math

from arealite.inference_client.errors import AttemptFailure
from arealite.inference_client.wire import Segment

__all__ = ["LOGPROB_SLACK", "MAX_VERSION", "check_segment"]

#: Largest log-prob accepted. A log-softmax is <= 0; fp32 rounding on the server can give
#: a few ulps above 0 for a near-certain token, which is kept as reported.
LOGPROB_SLACK = 1e-3
#: Largest policy version a server may report (versions count training steps).
MAX_VERSION = 2**53
_INT = {int}
_NUMBER = {float, int}


def _malformed(why: str) -> AttemptFailure:
    return AttemptFailure("malformed", why)


def _check_top(top: list, n: int, vocab_size: int | None) -> None:
    """The top log-probs: one list per token of (id, log-prob), ids and numbers as above."""
    if len(top) != n:
        raise _malformed(f"{len(top)} positions of top log-probs for {n} tokens")
    flat_ids = [t for pos in top for t, _ in pos]
    flat_lps = [x for pos in top for _, x in pos]
    if flat_ids:
        if set(map(type, flat_ids)) != _INT or min(flat_ids) < 0 or (
                vocab_size is not None and max(flat_ids) >= vocab_size):
            raise _malformed("a top log-prob names a token id that is not an int within the vocabulary")
        if not set(map(type, flat_lps)) <= _NUMBER or not (
                max(flat_lps) <= LOGPROB_SLACK and math.isfinite(sum(flat_lps))):
            raise _malformed("a top log-prob is not a finite number <= 0")


def check_segment(seg: Segment, budget: int, vocab_size: int | None) -> Segment:
    """Return ``seg`` if it is a possible answer to a request for at most ``budget`` new
    tokens from a model of ``vocab_size`` tokens (None: ids are only checked to be >= 0);
    raise a malformed-answer `AttemptFailure` naming the first violation otherwise."""
    ids, lps = seg.ids, seg.logprobs
    if len(ids) != len(lps):
        raise _malformed(f"{len(ids)} output tokens but {len(lps)} log-probs")
    if len(ids) > budget:
        raise _malformed(f"{len(ids)} output tokens for a budget of {budget} (max_new_tokens)")
    if ids:
        # Exact types (bool is a subclass of int, and refused); map/set/min/max loop in C.
        if set(map(type, ids)) != _INT:
            bad = next(t for t in ids if type(t) is not int)
            raise _malformed(f"output token id {bad!r:.40} is a {type(bad).__name__}, not an int")
        lo, hi = min(ids), max(ids)
        if lo < 0 or (vocab_size is not None and hi >= vocab_size):
            bad = lo if lo < 0 else hi
            raise _malformed(f"output token id {bad} is outside the vocabulary [0, {vocab_size or 'inf'})")
        if not set(map(type, lps)) <= _NUMBER:
            bad = next(x for x in lps if not (type(x) is float or type(x) is int))
            raise _malformed(f"log-prob {bad!r:.40} is a {type(bad).__name__}, not a number")
        top = max(lps)
        if not (top <= LOGPROB_SLACK and math.isfinite(sum(lps))):  # NaN fails every comparison
            bad = next((x for x in lps if not (math.isfinite(x) and x <= LOGPROB_SLACK)), top)
            raise _malformed(f"log-prob {bad!r} is not a finite number <= 0")
    if seg.top is not None:
        _check_top(seg.top, len(ids), vocab_size)
    v = seg.version
    if v is not None and not 0 <= v <= MAX_VERSION:
        raise _malformed(f"weight version {v!r:.40} is outside [0, 2**53]")
    return seg
