"""`RLTrainer`: the asynchronous RL loop, as a library.

    RLTrainer(config).train()                        # workflow named in config
    RLTrainer(config, workflow=MyWorkflow(...)).train()

Every trainer rank (under torchrun) runs the same loop on its own share of the prompts;
rank 0 alone talks to the servers about weights and writes stats. One step:

1. take a batch of trajectory groups from the rollout controller (generated while the
   previous step trained, within the staleness bound);
2. recompute proximal and reference log-probs where the loss needs them, then compute
   advantages (pure functions of the batch);
3. PPO/GRPO update on packed micro-batches;
4. publish the new weights (pause, transfer, verify, set the version everywhere, resume);
5. log the step's stats, evaluate and checkpoint when due.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import AutoTokenizer

from arealite.algo.actor import PPOActor
from arealite.api.contracts import RolloutSide, TrainEngine
from arealite.check import check_names
from arealite.config.run import run_dir
from arealite.config.schema import ArealiteConfig
from arealite.trainer import build
from arealite.trainer.checkpoint import Checkpointer, fault_point
from arealite.trainer.colocation import TimeSharing
from arealite.trainer.evaluation import evaluate
from arealite.trainer.hooks import TrainerHook
from arealite.trainer.stats_logger import StatsLogger, plot_reward_curve
from arealite.trainer.step_stats import StepStats, reduce_stats
from arealite.utils import accounting
from arealite.utils.heap import freeze_heap
from arealite.utils.json_types import JsonObject
from arealite.utils.progress import Progress
from arealite.weight_sync import make_publisher
from arealite.weight_sync.publisher import WeightPublisher
from arealite.workflow.base import RolloutWorkflow
from arealite.workflow.registry import samples_at_eval

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from arealite.critic import Critic, WithCritic

logger = logging.getLogger("arealite.trainer")


class RLTrainer:
    """Owns one run: data, engines, rollout, weight publishing, checkpoints, stats.

    ``workflow``: the training workflow (default: built from ``rollout.workflow``).
    ``eval_workflow``: the held-out evaluation workflow (default: the configured workflow
    built with greedy, one-sample generation; or ``workflow`` itself when one is given).
    With ``rollout.worker: process`` (the default) both are pickled to the rank's rollout
    worker process.
    ``hooks``: `TrainerHook` instances called at the loop's fixed points.

    What is built from config is built by `train` (`_setup`, `_resume`), not here.
    """

    # config and run: what was asked for, which rank this is, where the run writes
    config: ArealiteConfig
    rank: int
    world: int
    out_dir: Path
    total_steps: int
    # data: the tokenizer, the prompts, this rank's loader of training prompts
    tokenizer: PreTrainedTokenizerBase
    train_items: list[JsonObject]
    eval_items: list[JsonObject]
    loader: accounting.EpochTagged
    # engines and actor: what trains (the reference and the critic when the loss needs them)
    actor_engine: TrainEngine
    ref_engine: TrainEngine | None
    critic: Critic | None
    actor: PPOActor
    # rollout side: the workflows given (None: from config) and what runs them
    workflow: RolloutWorkflow | None
    eval_workflow: RolloutWorkflow | None
    rollout: RolloutSide
    # publishing and checkpoints: new weights to the servers, run state to disk
    publisher: WeightPublisher
    time_sharing: TimeSharing | None  # launch.placement=colocated: the turns on the GPUs
    checkpointer: Checkpointer
    _checkpointed: TrainEngine | WithCritic
    # stats and progress: steps done, the stats file, the bar, how evaluation samples
    step: int
    stats_logger: StatsLogger
    progress: Progress
    _eval_greedy: bool
    _eval_samples: int
    # hooks and teardown: the user's hooks; what was opened, closed newest first
    hooks: list[TrainerHook]
    _closers: list[Callable[[], object]]

    def __init__(self, config: ArealiteConfig, workflow: RolloutWorkflow | None = None,
                 eval_workflow: RolloutWorkflow | None = None, hooks: Sequence[TrainerHook] = ()):
        for name, wf in (("workflow", workflow), ("eval_workflow", eval_workflow)):
            if wf is not None and not callable(getattr(wf, "arun_episode", None)):
                raise TypeError(f"RLTrainer {name} is a {type(wf).__name__}, which has no "
                                "`async arun_episode(client, item)`: pass a RolloutWorkflow")
        # A config built in code has not been through `load_run_config`: a bad name fails here,
        # not after the engines have loaded.
        check_names(config, workflow_from_config=workflow is None)
        self.config = config
        self.hooks = list(hooks)
        self.workflow = workflow
        self.eval_workflow = eval_workflow
        self.rank, self.world = build.rank_and_world()
        self.out_dir: Path = run_dir(config)
        self.step = 0
        self.time_sharing = None
        self._closers = []

    @property
    def version(self) -> int:
        """The policy version the inference servers hold: one more per step done."""
        return self.step

    # ------------------------------------------------------------------ the loop
    def train(self) -> JsonObject:
        """Run (or resume) the whole training; returns the final record (evaluations included)."""
        if not faulthandler.is_enabled():  # a crash in native code leaves every thread's stack in the log
            faulthandler.enable()
        try:
            self._setup()
            start = self._resume()
            if self.config.rollout.freeze_gc:
                freeze_heap()  # engines, model and libraries live as long as the run
            self._call("on_train_start", start)
            before = self._evaluate(start, label="before RL")
            for step in range(start, self.total_steps):
                self._train_step(step)
            return self._finish(before)
        finally:
            self._teardown()

    def _train_step(self, step: int) -> None:
        cfg, version = self.config, step  # the servers hold version `step` now
        stats = StepStats(version)
        batch = self.rollout.prepare_batch()
        stats.lap("rollout_wait")
        if self.time_sharing is not None:  # the servers sleep, the trainer's state comes back
            self.time_sharing.trainer_turn()
            fault_point("asleep", step + 1)  # tests: a trainer that dies while the servers sleep
            stats.lap("switch")
        dropped = self.rollout.take_dropped()  # sent with the batch by a rollout worker
        self._call("on_batch", step, batch)
        actor = self.actor
        if actor.needs_prox_logp:  # decoupled PPO with several mini-batches
            batch["prox_logp"] = actor.compute_logp(batch)
        if self.ref_engine is not None:
            batch["ref_logp"] = actor.compute_logp(batch, engine=self.ref_engine)
        if self.critic is not None:  # PPO with GAE: the value of every state, before either update
            batch["values"] = self.critic.compute_values(batch)
        actor.compute_advantages(batch)
        stats.add_train(actor.ppo_update(batch))
        if self.critic is not None:
            stats.add("critic", self.critic.update(batch, actor.train_mask(batch)))
        stats.lap("train")
        stats.add("weight_sync", self._publish(version + 1))
        stats.lap("weight_sync")
        if self.time_sharing is not None:
            stats.add("colocation", self.time_sharing.take_timings())  # release, onload, offload, wakes
        stats.add_batch(batch)
        stats.add_accounting(self.rollout.last_batch_items, dropped)
        side = self.rollout.stats()  # as read at the push's pause (`LocalRollout.pause`)
        stats.add_rollout_side(side["controller"], side["client"])
        record = stats.finish()
        done = step + 1
        if cfg.evaluation.freq_steps and done % cfg.evaluation.freq_steps == 0 and done < self.total_steps:
            record.update(evaluate(self.rollout, self.eval_items, self._eval_samples))
        self.stats_logger.log(done, record)
        fault_point("step", done)
        self.progress.update(done, record)
        if self.checkpointer.due(done):
            with self._state_on_device():
                self.checkpointer.save(done, self._checkpointed, self.rollout.controller_state,
                                       self.rollout.loader_state)
        self.step = done
        self._call("on_step_end", done, record)

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        cfg = self.config
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.actor.model_path)
        self.train_items, self.eval_items = build.load_data(cfg, self.tokenizer)
        self.loader = build.make_loader(cfg, self.train_items, self.rank, self.world)
        self.total_steps = cfg.data.max_train_steps or len(self.loader) * cfg.data.total_train_epochs
        self.checkpointer = Checkpointer(self.out_dir / "checkpoints", cfg.saver, cfg.recover)
        self.checkpointer.check_mode()  # recover.mode=required without a checkpoint fails before engines
        self._eval_greedy = self.workflow is None or self.eval_workflow is not None
        self.actor_engine, self.ref_engine = build.build_train_engines(cfg, self.total_steps)
        self._closers.append(self.actor_engine.destroy)
        self.critic = build.build_critic(cfg, self.total_steps)
        if self.critic is not None:
            self._closers.append(self.critic.engine.destroy)
        # What a checkpoint saves and restores: the actor's engine, and the critic's beside it.
        self._checkpointed = build.checkpointed_engines(self.actor_engine, self.critic)
        self._eval_samples = cfg.evaluation.n_samples if samples_at_eval(cfg, self.workflow) else 1
        self.actor = build.build_actor(cfg, self.actor_engine, self.ref_engine)
        self.rollout = build.build_rollout(cfg, self.tokenizer, self.loader, self.world,
                                           self.workflow, self.eval_workflow)
        self._closers.append(self.rollout.stop)

    def _resume(self) -> int:
        """Restore the latest checkpoint (per `recover.mode`), start the rollout side, and
        bring the servers to the resumed version; returns the step to start from."""
        cfg = self.config
        start = self.checkpointer.maybe_resume(self._checkpointed, self.rollout.controller_state,
                                               self.rollout.loader_state)
        self.rollout.start(start)
        if cfg.launch.placement == "colocated":
            engines = [e for e in (self.actor_engine, self.ref_engine, self.critic and self.critic.engine) if e]
            self.time_sharing = TimeSharing(cfg.launch.time_sharing, engines, self.rollout.admin,
                                            self.rollout.run, self.rank, self.out_dir / "servers_asleep.json")
            self.time_sharing.wake_at_start()  # a trainer that died may have left them asleep
        self.publisher = make_publisher(cfg, self.rollout, self.actor_engine,
                                        probe_prompt=build.probe_prompt(cfg, self.tokenizer, self.train_items),
                                        after_read=self.time_sharing and self.time_sharing.after_read)
        self.publisher.init()
        self._closers.append(self.publisher.close)
        # Always, also at step 0: the servers may hold other weights than this run's (a killed
        # run's pushes, half of a push) and may have been left paused by a trainer that died.
        self._publish(start)
        self.stats_logger = StatsLogger(self.out_dir, cfg.stats, rank=self.rank,
                                        run_name=f"{cfg.experiment.name}/{cfg.experiment.trial}",
                                        full_config=cfg.model_dump(mode="json"))
        self._closers.append(self.stats_logger.close)
        self.stats_logger.log(start, {accounting.START: start})  # supersedes a killed run's later records
        self.progress = Progress(self.total_steps, start, enabled=cfg.stats.progress_bar and self.rank == 0)
        self._closers.append(self.progress.close)
        self.step = start
        return start

    def _publish(self, version: int) -> dict[str, float]:
        if self.time_sharing is not None:  # wake the servers' weights first, offload once read
            return self.time_sharing.publish(self.publisher, version)
        return self.publisher.publish(version)

    def _state_on_device(self) -> contextlib.AbstractContextManager:
        if self.time_sharing is not None:
            return self.time_sharing.state_on_device()
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ end
    @property
    def _eval_name(self) -> str:
        return "greedy accuracy" if self._eval_greedy else "accuracy"

    def _evaluate(self, step: int, label: str) -> dict[str, float]:
        if not self.eval_items:
            return {}
        out = evaluate(self.rollout, self.eval_items, self._eval_samples)
        self.stats_logger.log(step, out)
        if self.rank == 0:
            print(f"[arealite] held-out {self._eval_name} {label}: {out['eval/accuracy']:.1%}", flush=True)
        return out

    def _finish(self, before: dict[str, float]) -> JsonObject:
        """Close the accounting, evaluate, plot and export; returns the final record."""
        cfg, total = self.config, self.total_steps
        end = accounting.unfinished_fields(self.rollout.unfinished_state())
        end["data/epochs_handed_out_per_rank"] = [self.rollout.epochs_handed_out()]
        end = reduce_stats(end)
        end[accounting.EPOCHS_DONE] = min(end["data/epochs_handed_out_per_rank"])
        self.stats_logger.log(total, {accounting.END: total, **end})
        after = self._evaluate(total, label="after RL")
        self.progress.close()
        if self.rank == 0 and before and after:
            print(f"[arealite] held-out {self._eval_name}: before RL {before['eval/accuracy']:.1%}, "
                  f"after RL {after['eval/accuracy']:.1%}", flush=True)
        if self.rank == 0 and cfg.stats.plot:
            png = plot_reward_curve(self.stats_logger.path, self.out_dir / "reward_curve.png",
                                    title=f"{cfg.experiment.name}/{cfg.experiment.trial}")
            print(f"[arealite] stats: {self.stats_logger.path}  reward curve: {png}", flush=True)
        if self.time_sharing is not None:  # the export reads the weights: they stay on the device now
            self.time_sharing.onload_for_good()
        if cfg.saver.export_hf_at_end:
            self.actor_engine.export_hf(self.out_dir / "final_model")
        if cfg.saver.export_merged_at_end and cfg.actor.lora is not None:
            self.actor_engine.export_hf(self.out_dir / "final_model_merged", merged=True)
        final = {**{f"before/{k}": v for k, v in before.items()}, **after, **end}
        self._call("on_train_end", final)
        return final

    def _teardown(self) -> None:
        """Close what was opened, newest first; a failing close is logged, never masks the error."""
        while self._closers:
            close = self._closers.pop()
            try:
                close()
            except Exception:  # teardown goes on: the remaining parts must still be closed
                logger.exception("teardown: %s failed", getattr(close, "__qualname__", close))

    def _call(self, event: str, *args: object) -> None:
        for hook in self.hooks:
            getattr(hook, event)(self, *args)
