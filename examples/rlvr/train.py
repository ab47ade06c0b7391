"""Asynchronous GRPO with verifiable rewards: the CPU demo, the GPU recipe, and a template.

    python -m arealite.launcher.local examples/rlvr/train.py \
        --config examples/reverse_digits/config.yaml [key=value ...]

Every trainer rank (torchrun) runs this loop on its own share of the prompts; rank 0 alone
pushes weights and writes stats. A task is a JSONL dataset plus a reward function
(`data.reward_fn`); for multi-turn or agentic tasks swap `RLVRWorkflow` for your own
`RolloutWorkflow`. The loop stays the same.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from transformers import AutoTokenizer

from arealite.algo.actor import PPOActor
from arealite.config.loader import parse_args
from arealite.data.dataset import StatefulDataLoader, load_jsonl
from arealite.data.validate import validate_datasets
from arealite.engine.fsdp import FSDPEngine
from arealite.engine.sglang_remote import RemoteSGLangEngine
from arealite.reward import load_reward_fn
from arealite.rollout.controller import RolloutController
from arealite.utils import accounting
from arealite.utils.checkpoint import Checkpointer, fault_point
from arealite.utils.progress import Progress
from arealite.utils.run import batch_stats, evaluate, reduce_stats, run_dir, server_addrs, server_api_key
from arealite.utils.stats_logger import StatsLogger, plot_reward_curve
from arealite.weight_sync import make_weight_sync
from arealite.workflow.rlvr import RLVRWorkflow


CLIENT_COUNTS = ("requests", "retries", "timeouts", "connection_errors", "http_5xx", "malformed",
                 "evicted", "interrupted_requests", "marked_unhealthy", "recovered")


def main(argv: list[str]) -> None:
    cfg = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    out_dir = run_dir(cfg)

    # --- data: each rank takes its own share of every batch of prompts
    train_items = load_jsonl(cfg.data.train_path, cfg.data.prompt_key, cfg.data.answer_key)
    eval_items = load_jsonl(cfg.data.eval_path, cfg.data.prompt_key, cfg.data.answer_key) if cfg.data.eval_path else []
    eval_items = eval_items[: cfg.evaluation.max_prompts or len(eval_items)]
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor.model_path)
    validate_datasets(cfg, tokenizer, train_items, eval_items)  # every bad prompt named, before anything starts

    # --- trainer: FSDP2 engine (joins the torchrun process group) and the PPO actor
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    loader = StatefulDataLoader(train_items, cfg.rollout.consumer_batch_size // world, shuffle=cfg.data.shuffle,
                                seed=cfg.experiment.seed, rank=rank, world_size=world)
    loader = accounting.EpochTagged(loader)  # items remember their epoch: per-prompt accounting in the stats
    total_steps = cfg.data.max_train_steps or len(loader) * cfg.data.total_train_epochs
    ckpt = Checkpointer(out_dir / "checkpoints", cfg.saver, cfg.recover)
    ckpt.check_mode()  # recover.mode=required without a checkpoint fails here, before any engine is built
    actor_engine = FSDPEngine(cfg.actor).initialize(total_steps=total_steps)
    ref_engine = FSDPEngine(cfg.actor, frozen=True).initialize() if cfg.algorithm.kl_coef > 0 else None
    temperature = cfg.actor.temperature or cfg.generation.temperature or 1.0
    actor = PPOActor(cfg.algorithm, actor_engine, temperature=temperature, ref_engine=ref_engine,
                     max_new_tokens=cfg.generation.max_new_tokens)

    # --- rollout: client + controller (uvloop in a background thread) + workflows
    client = RemoteSGLangEngine(server_addrs(cfg), cfg.rollout, api_key=server_api_key(cfg),
                                eos_token_ids=[tokenizer.eos_token_id])
    controller = RolloutController(client, cfg.rollout, world_size=world)
    reward_fn = load_reward_fn(cfg.data.reward_fn)
    workflow = RLVRWorkflow(reward_fn, cfg.generation, tokenizer, cfg.rollout,
                            prompt_key=cfg.data.prompt_key, apply_chat_template=cfg.data.apply_chat_template)
    eval_gen = cfg.generation.model_copy(update={"n_samples": 1, "greedy": True,
                                                 "max_new_tokens": cfg.evaluation.max_new_tokens or cfg.generation.max_new_tokens})
    eval_workflow = RLVRWorkflow(reward_fn, eval_gen, tokenizer, cfg.rollout,
                                 prompt_key=cfg.data.prompt_key, apply_chat_template=cfg.data.apply_chat_template)

    # --- resume from the latest complete checkpoint (recover.mode), before the controller starts
    controller.record_dropped = True  # rejected/failed prompts are listed in the stats too
    start_step = ckpt.maybe_resume(actor_engine, controller, loader)
    controller.set_version(start_step)
    controller.start()
    weight_sync = make_weight_sync(cfg, client, actor_engine, controller.run)
    weight_sync.init()
    if start_step > 0:  # the servers may hold older weights than the checkpoint
        weight_sync.push(actor_engine, version=start_step)

    stats_logger = StatsLogger(out_dir, cfg.stats, rank=rank, run_name=f"{cfg.experiment.name}/{cfg.experiment.trial}",
                               full_config=cfg.model_dump(mode="json"))
    stats_logger.log(start_step, {accounting.START: start_step})  # supersedes a killed run's later records
    eval_before = evaluate(controller, eval_items, eval_workflow) if eval_items else {}
    if rank == 0 and eval_items:
        print(f"[arealite] held-out greedy accuracy before RL: {eval_before['eval/accuracy']:.1%}", flush=True)
        stats_logger.log(start_step, eval_before)
    progress = Progress(total_steps, start_step, enabled=cfg.stats.progress_bar and rank == 0)

    for step in range(start_step, total_steps):
        version = step  # the policy version that the servers hold now
        t0 = time.perf_counter()
        # 1. a batch of groups, generated while the previous step trained
        batch = controller.prepare_batch(loader, workflow)
        t_rollout = time.perf_counter()
        # 2. proximal log-probs with the current weights (decoupled PPO; with one mini-batch the
        #    training forward provides them), 3. advantages (pure functions)
        if actor.needs_prox_logp:
            batch["prox_logp"] = actor.compute_logp(batch)
        if ref_engine is not None:
            batch["ref_logp"] = actor.compute_logp(batch, engine=ref_engine)
        actor.compute_advantages(batch)
        # 4. PPO update on packed micro-batches
        train_stats = actor.ppo_update(batch)
        t_train = time.perf_counter()
        # 5. push the new weights; in-flight generations are interrupted and resume on them
        controller.pause()
        sync_stats = weight_sync.push(actor_engine, version=version + 1)
        actor_engine.set_version(version + 1)
        controller.set_version(version + 1)
        controller.resume()
        t_sync = time.perf_counter()

        stats = batch_stats(batch, version)
        stats.update(accounting.step_fields(controller.last_batch_items, controller.take_dropped()))
        for mb_stats in train_stats:  # mean over mini-batches
            for k, v in mb_stats.items():
                stats[f"train/{k}"] = stats.get(f"train/{k}", 0.0) + v / len(train_stats)
        stats.update({f"weight_sync/{k}": v for k, v in sync_stats.items()})
        stats.update({
            "time/rollout_wait_s": t_rollout - t0, "time/train_s": t_train - t_rollout,
            "time/weight_sync_s": t_sync - t_train, "time/step_s": t_sync - t0,
            "perf/train_tokens_per_s": stats["rollout/n_tokens"] / max(t_train - t_rollout, 1e-9),
        })
        cstats = controller.stats()
        stats.update({f"controller/{k}": float(v) for k, v in cstats.items() if isinstance(v, (int, float))})
        client_stats = client.stats()  # retries, failures by cause, servers out of rotation (summed over ranks)
        stats.update({f"client/{k}": float(client_stats[k]) for k in (*CLIENT_COUNTS, "n_healthy")})
        stats = reduce_stats(stats, sum_keys=[f"client/{k}" for k in CLIENT_COUNTS])
        stats["rollout/epoch"] = min(stats[accounting.EPOCHS], default=-1)
        if cfg.evaluation.freq_steps and (step + 1) % cfg.evaluation.freq_steps == 0 and step + 1 < total_steps:
            stats.update(evaluate(controller, eval_items, eval_workflow))
        stats_logger.log(step + 1, stats)
        fault_point("step", step + 1)
        progress.update(step + 1, stats)
        ckpt.maybe_save(step + 1, actor_engine, controller, loader)

    # What this run leaves untrained (in flight, ready, not yet submitted): closes the accounting.
    end = accounting.unfinished_fields(controller.state_dict())
    end["data/epochs_handed_out_per_rank"] = [loader.epochs_handed_out()]
    end = reduce_stats(end)
    end[accounting.EPOCHS_DONE] = min(end["data/epochs_handed_out_per_rank"])
    stats_logger.log(total_steps, {accounting.END: total_steps, **end})
    eval_after = evaluate(controller, eval_items, eval_workflow) if eval_items else {}
    progress.close()
    if rank == 0:
        if eval_items:
            stats_logger.log(total_steps, eval_after)
            print(f"[arealite] held-out greedy accuracy: before RL {eval_before['eval/accuracy']:.1%}, "
                  f"after RL {eval_after['eval/accuracy']:.1%}", flush=True)
        if cfg.stats.plot:
            png = plot_reward_curve(stats_logger.path, out_dir / "reward_curve.png",
                                    title=f"{cfg.experiment.name}/{cfg.experiment.trial}")
            print(f"[arealite] stats: {stats_logger.path}  reward curve: {png}", flush=True)
    if cfg.saver.export_hf_at_end:
        actor_engine.export_hf(out_dir / "final_model")
    stats_logger.close()
    weight_sync.close()
    controller.stop()
    actor_engine.destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
