"""A completion's MoE routing, put together from its segments.

Each segment's ``meta_info.routed_experts`` covers every token that segment's forward
passes ran: its whole input (the prompt and what earlier segments generated) and its
output but the last token. A resumed segment re-runs the earlier tokens, perhaps under
new weights; each row is kept from the segment that first ran it, so that a token's
routing is the one its behaviour log-prob was computed with, as each token keeps its
version. New rows are appended.
"""

from __future__ import annotations

import torch

from arealite.inference_client.errors import AttemptFailure


class RoutingRows:
    """The ``[rows, layers * top_k]`` int32 routing of one completion, grown segment by segment."""

    __slots__ = ("_parts", "_n", "_width")

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []
        self._n = 0
        self._width = 0

    def extend(self, flat: torch.Tensor, n_rows: int) -> None:
        """Take a segment's flat routing, which covers ``n_rows`` tokens from the start. An empty
        one (a segment aborted before its first forward pass, e.g. by a weight update's pause)
        adds nothing."""
        if n_rows <= 0 or flat.numel() == 0:
            return
        if flat.numel() % n_rows:
            raise AttemptFailure("malformed", f"meta_info.routed_experts holds {flat.numel()} ids for {n_rows} "
                                              "tokens (prompt + output - 1): not a whole number per token")
        width = flat.numel() // n_rows
        if self._width and width != self._width:
            raise AttemptFailure("malformed", f"meta_info.routed_experts has {width} ids per token, an earlier "
                                              f"segment had {self._width}")
        self._width = width
        if n_rows > self._n:
            self._parts.append(flat.view(n_rows, width)[self._n:])
            self._n = n_rows

    def rows(self) -> torch.Tensor | None:
        """The routing so far (None when no segment reported any)."""
        if not self._parts:
            return None
        return self._parts[0] if len(self._parts) == 1 else torch.cat(self._parts)
