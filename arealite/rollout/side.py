"""The rollout side of one trainer rank, as the trainer sees it: `LocalRollout`.

It joins what produces training batches: the inference client, the `RolloutController`,
this rank's dataloader and the workflows (training and evaluation). The trainer talks to
it through the `RolloutSide` contract (`arealite.api.contracts`), so that the same loop runs
it in the trainer's own process (`LocalRollout`) or in a child process
(`arealite.rollout.worker.RolloutWorker`, which runs a `LocalRollout` there).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from tensordict import TensorDict, TensorDictBase

from arealite.api.contracts import InferenceClient, Runner, WeightUpdateAdmin
from arealite.config.schema import RolloutConfig
from arealite.reward.metrics import episode_scores
from arealite.rollout.controller import ControllerState, RolloutController
from arealite.utils.json_types import JsonObject
from arealite.workflow.base import RolloutWorkflow


class ItemLoader(Protocol):
    """This rank's dataloader as the rollout side uses it (an `arealite.utils.accounting.EpochTagged`
    `StatefulDataLoader`): lists of items, epoch after epoch, and a checkpoint state."""

    def __iter__(self) -> Iterator[list[JsonObject]]: ...

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: dict[str, int]) -> None: ...

    def epochs_handed_out(self) -> int: ...


def episode_sums(run: Runner, client: InferenceClient, items: Sequence[JsonObject],
                 workflow: RolloutWorkflow, max_concurrency: int = 64, ks: Sequence[int] = ()) -> dict[str, float]:
    """Run `workflow` once on every item (outside the training queue and the staleness
    accounting); returns the sums of `arealite.reward.metrics.episode_scores` (rows with
    reward > 0.5, rows, reward, lengths, truncations, prompts, pass@k for ``ks``)."""

    async def run_all() -> list[TensorDict | None]:
        sem = asyncio.Semaphore(max_concurrency)

        async def one(item: JsonObject) -> TensorDict | None:
            async with sem:
                return await workflow.arun_episode(client, item)

        return await asyncio.gather(*(one(it) for it in items))

    return episode_scores(run(run_all()) if items else [], list(ks))


class LocalRollout:
    """Client, controller, dataloader and workflows of one rank, in this process."""

    def __init__(self, client: InferenceClient, config: RolloutConfig, loader: ItemLoader, world_size: int,
                 workflow: RolloutWorkflow, eval_workflow: RolloutWorkflow,
                 sampled_eval_workflow: RolloutWorkflow | None = None):
        self.client = client
        self.controller = RolloutController(client, config, world_size=world_size)
        self.controller.record_dropped = True  # rejected/failed prompts are listed in the stats too
        self.loader = loader
        self.workflow, self.eval_workflow = workflow, eval_workflow
        # Several sampled answers per held-out prompt (pass@k); None: greedy evaluation only.
        self.sampled_eval_workflow = sampled_eval_workflow
        self._stats_at_pause: dict[str, dict[str, Any]] | None = None

    # What the checkpointer saves and restores ("controller", "dataloader").
    @property
    def controller_state(self) -> RolloutController:
        return self.controller

    @property
    def loader_state(self) -> ItemLoader:
        return self.loader

    @property
    def last_batch_items(self) -> list[JsonObject]:
        return self.controller.last_batch_items

    @property
    def admin(self) -> WeightUpdateAdmin:
        return self.client.admin  # type: ignore[attr-defined]

    @property
    def run(self) -> Runner:
        return self.controller.run

    def start(self, version: int) -> None:
        self.controller.set_version(version)
        self.controller.start()

    def prepare_batch(self) -> TensorDictBase:
        return self.controller.prepare_batch(self.loader, self.workflow)

    def take_dropped(self) -> list[JsonObject]:
        return self.controller.take_dropped()

    def pause(self) -> None:
        """Around a weight update: admit no new episodes, and hold the requests that the
        servers' pause aborts until `resume`, so that the publisher's checks after
        ``continue_generation`` (the log-prob probe) find the servers idle rather than
        behind a burst of resubmissions. The stats are read first, as they stand at the
        end of the step: the next `stats()` returns them (asked after the resume, they
        would wait behind the episodes it launches)."""
        self._stats_at_pause = self._read_stats()
        self.controller.pause()
        self.client.pause()

    def resume(self) -> None:
        self.client.resume()
        # A batch already ready is taken before the released episodes launch (see
        # `RolloutController.resume`): the trainer asks for it right after this call.
        self.controller.resume(prefetch=(self.loader, self.workflow))

    def set_version(self, version: int) -> None:
        self.controller.set_version(version)
        self.client.set_version(version)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Controller and client figures: the ones read at the last pause if no call has
        taken them yet, else read now."""
        snap, self._stats_at_pause = self._stats_at_pause, None
        return snap if snap is not None else self._read_stats()

    def _read_stats(self) -> dict[str, dict[str, Any]]:
        return {"controller": self.controller.stats(), "client": self.client.stats()}

    def unfinished_state(self) -> ControllerState:
        """The controller's state: what is in flight, ready or not yet submitted."""
        return self.controller.state_dict()

    def epochs_handed_out(self) -> int:
        return self.loader.epochs_handed_out()

    def eval_sums(self, items: Sequence[JsonObject], ks: Sequence[int] = ()) -> dict[str, float]:
        """Greedy evaluation sums of ``items``; with ``ks``, the sampled evaluation's (pass@k)."""
        if ks:
            if self.sampled_eval_workflow is None:
                raise RuntimeError("no sampled evaluation workflow: evaluation.n_samples is 1, or the run "
                                   "was given its own workflow objects")
            return episode_sums(self.controller.run, self.client, items, self.sampled_eval_workflow, ks=ks)
        return episode_sums(self.controller.run, self.client, items, self.eval_workflow)

    def stop(self) -> None:
        self.controller.stop()
