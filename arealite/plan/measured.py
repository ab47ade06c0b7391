"""The measured side of the planner's check: the peak of live tensor bytes of one train step.

`step_peak` runs ``engine.train_batch`` under torch's own ``MemTracker``
(``torch.distributed._tools.mem_tracker``), a dispatch mode that counts every tensor storage
alive (freed ones leave when their last reference dies; FSDP2's storage resizes are followed),
with the model's parameters and the optimizer's state registered before. Allocator caching
and fragmentation are not in it: it is what the planner predicts, measured on any device.
"""

from __future__ import annotations

import torch

__all__ = ["step_peak"]


def _tracker():
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepTracker(MemTracker):
        """MemTracker without its per-module statistics, which refuse a module run twice in
        one step (several micro-batches) and put gradient hooks on frozen parameters (LoRA's
        base); the totals are the same, a gradient then counts as a temporary."""

        def _pre_fw_hook(self, module, inputs):
            pass

        def _post_fw_hook(self, module, inputs, outputs):
            pass

        def _pre_bw_hook(self, module, args):
            pass

        def _post_bw_hook(self, module, args):
            pass

    return StepTracker()


def step_peak(engine, batch, loss_fn, loss_weight_fn) -> dict[str, int]:
    """One ``engine.train_batch`` measured: ``{"peak": bytes, <category>: bytes at the peak}``
    (categories: Parameter, Gradient, Optstate, Activation, Temp, ...)."""
    tracker = _tracker()
    tracker.track_external(engine.model, engine.optimizer)
    with tracker:
        engine.train_batch(batch, loss_fn, loss_weight_fn)
    snap = tracker.get_tracker_snapshot("peak")[torch.device(engine.device.type)]
    return {"peak": int(snap["Total"]), **{str(k.value): int(v) for k, v in snap.items() if hasattr(k, "value")}}
