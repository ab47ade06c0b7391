"""What a checkpoint keeps of a `RolloutController`, and how it comes back.

Saved: the staleness state and counters, the groups produced but not trained on yet
(ready, with the batch taken ahead at a resume put back in front), the items still running
or queued (resubmitted after a restart, not counted as new submissions), the dataloader
items pulled but not queued, and the dropped items not yet handed to the trainer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from arealite.rollout.controller import RolloutController


def controller_state(ctl: "RolloutController") -> dict[str, Any]:
    """The state of ``ctl`` (on its loop, or while it is stopped)."""
    ctl._unstash()  # not trained on yet: saved as ready
    pending = [j.item for j in ctl._running.values()] + [j.item for j in ctl._input] + ctl._feed.restored
    return {
        "staleness": ctl.staleness.state_dict(),
        "counters": dict(ctl._counters),
        **ctl._output.state_dict(),  # ready, staleness_hist
        "pending_items": pending,
        "unsubmitted_items": list(ctl._feed.leftover),
        "dropped_items": ctl._dropped.snapshot(),
    }


def restore_controller(ctl: "RolloutController", state: dict[str, Any]) -> None:
    """Load a `controller_state` into a controller that has not started."""
    ctl.staleness.load_state_dict(state["staleness"])
    ctl._version = ctl.staleness.version
    ctl._counters.update({k: int(v) for k, v in state["counters"].items()})
    ctl._output.load_state_dict(state)
    ctl._feed.restored = list(state["pending_items"])
    ctl._feed.leftover = list(state.get("unsubmitted_items", []))
    ctl._dropped.restore(state.get("dropped_items", []))
