"""The staleness bound of asynchronous RL, as a small pure object.

With consumer batch ``B`` (groups per training step on this rank), trainer
version ``v`` and ``max_head_offpolicyness`` ``eta``, at most
``(eta + v + 1) * B`` groups may ever have been accepted or be running. Had
groups been trained in the order they were admitted, none would be more than
``eta`` versions older than the policy that trains on it. They finish out of
order, though: a group behind a long answer is overtaken by groups admitted
after it, and could land one or two versions past ``eta`` (measured with the
simulated backend, docs/scale.md). Two rules keep the bound per trajectory: the
ready set takes the stalest groups first (`arealite.rollout.ready`), and a
training batch due at version ``v`` waits for a group still running that was
admitted at ``v - eta`` or before (left to the next batch it would be ``eta + 1``
versions stale), and for one admitted at ``v - eta + k`` when more of those run
than the ``k`` batches after this one can hold (`DataFeed.wait`,
`Admission.running_admitted_by`). Only when more than a batch of groups are that
stale at once can one be trained past ``eta``; the controller's histogram
(``staleness_hist``) shows it, not hides it.
``eta = 0`` is synchronous RL: the next batch is only generated once the
current one has been trained on and the version bumped.

The manager only counts; the controller calls it on every event. It holds no
locks: the controller touches it from its event-loop thread alone.

`trajectory_staleness` is the one definition of a trajectory's staleness
(trainer version minus the oldest version of its tokens), used by the
controller's histogram and by the training stats alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


#: The oldest version of a trajectory without any produced token: it sorts after every real one.
NO_PRODUCED_TOKEN = torch.iinfo(torch.int64).max


def produced_versions(versions: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``versions`` (int64) where the policy produced the token (``loss_mask``), else
    `NO_PRODUCED_TOKEN`: a minimum over any set of them is the oldest produced version."""
    return torch.where(loss_mask.bool(), versions.long(), NO_PRODUCED_TOKEN)


def oldest_versions(versions: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """The oldest policy version among each trajectory's produced tokens (``loss_mask``), over
    the last dimension; `NO_PRODUCED_TOKEN` where there is none. One ``where`` and one ``min``:
    on the rollout loop, once per group, it costs ~5 us where boolean indexing cost ~12."""
    return produced_versions(versions, loss_mask).amin(dim=-1)


def trajectory_staleness(versions: torch.Tensor, loss_mask: torch.Tensor, version: int) -> torch.Tensor:
    """Staleness ``[B]`` (int64) of each trajectory: ``version`` minus the oldest policy version
    among the tokens the policy produced (``loss_mask``).

    ``versions`` and ``loss_mask`` are ``[B, L]``. A trajectory with no produced token, or
    whose tokens are all newer than ``version`` (the trainer's version lags the servers'
    for a moment around a weight update), has staleness 0.
    """
    if versions.shape[-1] == 0:
        return torch.zeros(versions.shape[:-1], dtype=torch.int64, device=versions.device)
    oldest = oldest_versions(versions, loss_mask)
    stale = torch.where(oldest == NO_PRODUCED_TOKEN, 0, version - oldest)
    return stale.clamp(min=0)


def overdue_running(version: int, eta: int, batch: int, running: int,
                    running_admitted_by: Callable[[int], int], ready_admitted_by: Callable[[int], int]) -> bool:
    """Whether a batch of ``batch`` taken at ``version`` must wait for a running group: one
    admitted at ``version - eta + k`` or before must be trained in this batch or the ``k`` after
    it; when more such groups run than those ``k`` batches hold, one of them belongs in this one,
    and the batch waits for it unless ``batch`` ready groups are that stale already.
    ``running_admitted_by(v)`` / ``ready_admitted_by(v)``: running / ready groups admitted at ``v``
    or before. The controller's rule (`DataFeed.wait`), and the virtual-time pipeline's."""
    # Only k that can hold: no group is admitted before version 0 (k >= eta - version), and no
    # more than all the running ones can be that stale (k * batch < running). An unbounded eta
    # (a benchmark's 10**6) so costs a few steps per call, not eta.
    for k in range(max(0, eta - version), min(eta, running // batch) + 1):
        last = version - eta + k
        if running_admitted_by(last) > k * batch and ready_admitted_by(last) < batch:
            return True
    return False


@dataclass
class StalenessManager:
    """Counts running/accepted groups and says how many more may start."""

    max_concurrent: int
    consumer_batch_size: int
    max_head_offpolicyness: int
    version: int = 0
    running: int = 0
    accepted: int = 0

    def __post_init__(self) -> None:
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {self.max_concurrent}")
        if self.consumer_batch_size < 1:
            raise ValueError(
                f"consumer_batch_size must be >= 1 group per rank, got {self.consumer_batch_size}; "
                "check rollout.consumer_batch_size against the number of trainer ranks"
            )
        if self.max_head_offpolicyness < 0:
            raise ValueError(f"max_head_offpolicyness must be >= 0, got {self.max_head_offpolicyness}")

    @property
    def limit(self) -> int:
        """Most groups that may have been accepted or be running at this version."""
        return (self.max_head_offpolicyness + self.version + 1) * self.consumer_batch_size

    def capacity(self) -> int:
        """How many more groups may be admitted now (never negative)."""
        by_concurrency = self.max_concurrent - self.running
        by_staleness = self.limit - (self.accepted + self.running)
        return max(0, min(by_concurrency, by_staleness))

    def on_submit(self) -> None:
        """A group was admitted and starts running."""
        if self.capacity() <= 0:
            raise RuntimeError(
                f"staleness bound violated: admitting with running={self.running}, "
                f"accepted={self.accepted}, limit={self.limit}"
            )
        self.running += 1

    def on_accept(self) -> None:
        """A running group finished and was kept."""
        self._finish()
        self.accepted += 1

    def on_reject(self) -> None:
        """A running group finished and was rejected (or failed): its slot is free again."""
        self._finish()

    def on_unaccept(self, n: int = 1) -> None:
        """``n`` accepted groups were rejected later (a filter at consumption time)."""
        if n > self.accepted:
            raise RuntimeError(f"cannot un-accept {n} groups, only {self.accepted} accepted")
        self.accepted -= n

    def cancel_running(self) -> None:
        """Every running group was cancelled (the controller stopped): none runs any more."""
        self.running = 0

    def set_version(self, version: int) -> None:
        """The trainer's policy version moved (usually +1 after a weight update)."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        self.version = version

    def _finish(self) -> None:
        if self.running <= 0:
            raise RuntimeError("a group finished but none was running")
        self.running -= 1

    def state_dict(self) -> dict[str, int]:
        """Version and accepted count; running groups are resubmitted on resume."""
        return {"version": self.version, "accepted": self.accepted}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.version = int(state["version"])
        self.accepted = int(state["accepted"])
        self.running = 0
