"""A training scenario run both under ``torchrun --nproc_per_node 2`` and in one process.

``run(model_dir, out_dir)`` trains a few steps on a fixed global batch (each
rank takes its own slice of rows; ranks get deliberately unequal work so that
dummy micro-batches are exercised), saves a sharded checkpoint, takes one more
step, reloads and retakes it, computes log-probs and exports a HF directory,
then takes a PPO step with each sequence-mean loss aggregation (the ranks hold 5
and 3 sequences, so a rank-local mean would show). Every process runs on the
CPU (gloo), also on a GPU machine. Rank r writes ``result_rank{r}.pt``; tests/test_fsdp_dist.py compares worlds.

    torchrun --nproc_per_node N tests/_fsdp_worker.py MODEL_DIR OUT_DIR [lora | sp | tp | ep | LAYOUT]

With ``lora`` the engine is `LoraFSDPEngine` (rank-3 adapters on every linear module, so
that the A matrices split unevenly over 2 ranks): the same scenario trains only the
adapters, and rank r also writes the adapter's tensors. With ``sp`` (``tp``) the 2 ranks
are one sequence-parallel (tensor-parallel) group: each still hands the engine its own rows,
and the engine computes all 8 together. With ``ep`` (a mixture-of-experts model) the 2 ranks
split each layer's experts. ``LAYOUT`` composes degrees on 4 ranks, e.g. ``sp=2,tp=2`` or
``dp_replicate=2,sp=2`` (the keys: dp_replicate, sp, tp, ep); the 4 ranks hold 3, 2, 2 and 1 of
the rows. On a mixture-of-experts model every layout replays a fixed routing (R3: the batch
carries ``routed_experts``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arealite.algo.actor import PPOActor  # noqa: E402
from arealite.config.schema import ActorConfig, AlgorithmConfig, LoraConfig  # noqa: E402
from arealite.train_engine.fsdp import FSDPEngine  # noqa: E402
from arealite.weight_sync.disk import write_hf_shards  # noqa: E402

GLOBAL_B = 8
#: Each rank's rows in a world of 1, 2 or 4: unequal work, so that dummy micro-batches are exercised
#: (in a world of 2, rank 0 gets the long sequences, rank 1 the short ones).
ROWS = {1: [(0, 8)], 2: [(0, 5), (5, 8)], 4: [(0, 3), (3, 5), (5, 7), (7, 8)]}
#: The one-word layouts of 2 ranks.
LAYOUTS = {"sp": {"sp": 2}, "tp": {"tp": 2}, "ep": {"ep": 2}}


def parse_layout(mode: str) -> dict[str, int]:
    """``sp`` / ``tp`` / ``ep`` (2 ranks) or ``key=n,...`` with keys dp_replicate, sp, tp, ep."""
    if mode in LAYOUTS:
        return LAYOUTS[mode]
    if not mode or mode == "lora":
        return {}
    return {k: int(v) for k, v in (part.split("=") for part in mode.split(","))}


def global_batch(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A right-padded batch: 5 long sequences then 3 short ones, prompts of 3 tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = [30, 26, 28, 22, 25, 6, 4, 7]
    L = max(lengths)
    ids = torch.randint(5, vocab, (GLOBAL_B, L), generator=g)
    am = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    ids = ids * am
    loss_mask = am & (torch.arange(L)[None, :] >= 3)
    return {"input_ids": ids, "attention_mask": am, "loss_mask": loss_mask}


def with_routing(batch: dict[str, torch.Tensor], hf_config, seed: int = 1) -> dict[str, torch.Tensor]:
    """``batch`` with a server routing to replay (``routed_experts``: distinct random experts per
    token and layer, -1 at position 0 and padding) when the model is a mixture of experts."""
    n_experts = getattr(hf_config, "num_experts", None)
    if not n_experts:
        return batch
    g = torch.Generator().manual_seed(seed)
    B, L = batch["input_ids"].shape
    layers, k = hf_config.num_hidden_layers, hf_config.num_experts_per_tok
    experts = torch.rand(B, L, layers, n_experts, generator=g).argsort(-1)[..., :k].reshape(B, L, layers * k)
    real = batch["attention_mask"].clone()
    real[:, 0] = False
    return {**batch, "routed_experts": torch.where(real[..., None], experts, -1).to(torch.int16)}


def token_mean_ce(head, mb: dict) -> torch.Tensor:
    """Token-mean cross-entropy of ``labels`` over ``loss_mask`` (the fused head: under FSDP2 its
    weight is the root's gathered, tied embedding)."""
    logp = head.logprobs(mb["labels"])
    mask = mb["loss_mask"].float()
    mb["_stats"] = {"mean_logp": (logp * mask).sum() / mask.sum().clamp(min=1)}
    return -(logp * mask).sum() / mask.sum().clamp(min=1)


def n_loss_tokens(mb: dict) -> torch.Tensor:
    return mb["loss_mask"].sum()


def label_logprobs(head, mb: dict) -> torch.Tensor:
    return torch.log_softmax(head.logits(), dim=-1).gather(-1, mb["labels"][:, None])[:, 0]


def full_weights(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    """Every rank must iterate the buckets; all get the full tensors."""
    return {n: t.clone() for b in engine.named_weight_buckets(1 << 16) for n, t in b}


#: The losses added with issue 16, each a PPO step on the same batch (sequence-level pieces
#: are where a rank-local computation would show).
NEW_LOSSES = {
    "gspo": dict(policy_loss="gspo", eps_clip=0.05, loss_agg_mode="seq-mean-token-mean"),
    "gspo_token_tis_seq": dict(policy_loss="gspo_token", eps_clip=0.05, loss_agg_mode="seq-mean-token-mean",
                               mismatch=dict(mode="tis", level="sequence", upper=1.03, lower=0.97)),
    "ppo_mis_token": dict(mismatch=dict(mode="mis", level="token", upper=1.2)),
}


def new_loss_steps(engine: FSDPEngine, batch: dict, logp: torch.Tensor, rows: slice) -> tuple[dict, torch.Tensor]:
    """Advantages whitened over the global batch, then one step with each of `NEW_LOSSES`;
    the behaviour log-probs differ from the trainer's so that the mismatch correction acts."""
    from arealite.algo.returns import global_whiten

    L = batch["input_ids"].shape[1]
    raw = torch.cos(torch.arange(GLOBAL_B * L, dtype=torch.float32).reshape(GLOBAL_B, L))[rows]
    adv = global_whiten(raw, batch["loss_mask"])
    wiggle = 0.15 * torch.sin(torch.arange(GLOBAL_B * L, dtype=torch.float32).reshape(GLOBAL_B, L))
    row_shift = torch.linspace(-0.08, 0.08, GLOBAL_B)[:, None]  # some sequences' geometric mean leaves [0.97, 1.03]
    behav = logp + (wiggle + row_shift)[rows]
    data = {**batch, "logprobs": torch.where(batch["loss_mask"], behav, torch.zeros(())), "advantages": adv}
    out = {}
    for name, knobs in NEW_LOSSES.items():
        actor = PPOActor(AlgorithmConfig(**knobs), engine, temperature=1.0)
        out[name] = engine.train_batch(data, actor.loss_fn(), actor.loss_weight_fn())
    return out, adv


def run(model_dir: str, out_dir: str, lora: bool = False, layout: str = "") -> None:
    out = Path(out_dir)
    degrees = parse_layout(layout)
    cfg = ActorConfig(model_path=model_dir, mb_max_tokens=32,
                      lora=LoraConfig(rank=3, alpha=6.0) if lora else None,
                      dp_replicate=degrees.get("dp_replicate", 1), sp_size=degrees.get("sp", 1),
                      tp_size=degrees.get("tp", 1), ep_size=degrees.get("ep", 1))
    cfg.optimizer.lr = 1e-2 if lora else 2e-3
    cfg.optimizer.warmup_steps = 1
    cfg.optimizer.lr_scheduler = "cosine"
    cfg.optimizer.total_steps = 6
    cfg.optimizer.gradient_clipping = 0.5
    # Adam divides each gradient by its own size: at the default eps (1e-8) a weight whose gradient
    # is ~1e-9 (rounding noise of a sum taken in another order) moves by a sizeable part of the LR,
    # so comparing weights after steps would compare rounding, not layouts (seen: Mistral under tp,
    # a 1e-9 gradient, first-step gradients equal to 6e-9, weights 1.5e-5 apart after 4 steps).
    cfg.optimizer.eps = 1e-6
    if lora:
        from arealite.lora import LoraFSDPEngine

        engine: FSDPEngine = LoraFSDPEngine(cfg, device="cpu").initialize()
    else:
        engine = FSDPEngine(cfg, device="cpu").initialize()
    rank, world = engine.rank, engine.world_size
    if world not in ROWS:
        raise SystemExit(f"this scenario runs with {sorted(ROWS)} processes")
    rows = slice(*ROWS[world][rank])
    full_batch = with_routing(global_batch(engine.hf_config.vocab_size), engine.hf_config)
    batch = {k: v[rows] for k, v in full_batch.items()}
    if "routed_experts" in batch:
        engine.routing_replay = "r3"
    initial = full_weights(engine)
    pushed = out / "pushed"  # what a disk weight transfer writes, before any step
    if rank == 0:
        write_hf_shards(engine, pushed, 1 << 14)
    else:
        for _ in engine.named_weight_buckets(1 << 14):  # every rank takes part in the gathers
            pass

    stats = [engine.train_batch(batch, token_mean_ce, n_loss_tokens)]
    # The first step's (clipped) gradients, whole: the step leaves them on the parameters.
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for n, p in engine.model.named_parameters() if p.grad is not None}
    stats += [engine.train_batch(batch, token_mean_ce, n_loss_tokens) for _ in range(2)]
    ckpt = out / "ckpt"
    engine.save(ckpt)
    stats.append(engine.train_batch(batch, token_mean_ce, n_loss_tokens))
    after_4 = full_weights(engine)
    lr_after_4 = engine.optimizer.param_groups[0]["lr"]

    engine.load(ckpt)
    restored_3 = full_weights(engine)
    redo = engine.train_batch(batch, token_mean_ce, n_loss_tokens)
    redone_4 = full_weights(engine)
    lr_redone = engine.optimizer.param_groups[0]["lr"]
    logp = engine.forward(batch, label_logprobs)
    engine.export_hf(out / "hf")
    engine.set_version(7)

    # The real PPO loss, behaviour log-probs = the current ones, a different advantage per sequence.
    advantages = torch.linspace(-1.0, 1.0, GLOBAL_B)[rows, None] * batch["loss_mask"]
    ppo = {**batch, "logprobs": logp, "advantages": advantages}
    seq_mean = {}
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        actor = PPOActor(AlgorithmConfig(loss_agg_mode=mode, loss_agg_constant=16.0), engine, temperature=1.0)
        seq_mean[mode] = engine.train_batch(ppo, actor.loss_fn(), actor.loss_weight_fn())
    new_losses, whitened = new_loss_steps(engine, batch, logp, rows)
    torch.save(
        {
            "world": world,
            "initial": initial,
            "grads": grads,
            "stats": stats,
            "redo": redo,
            "after_4": after_4,
            "restored_3": restored_3,
            "redone_4": redone_4,
            "lr_after_4": lr_after_4,
            "lr_redone": lr_redone,
            "logp": logp,
            "seq_mean": seq_mean,
            "new_losses": new_losses,
            "whitened": whitened,
            "after_new_losses": full_weights(engine),
            "after_seq_mean": full_weights(engine),
            "rows": (rows.start, rows.stop),
            "adapter": ({n: t.clone() for b in engine.adapter_buckets(1 << 16) for n, t in b} if lora else {}),
            "n_trainable": sum(p.numel() for p in engine.model.parameters() if p.requires_grad),
            "layout": (engine.layout.dp, engine.layout.sp, engine.layout.tp),
            "degrees": (engine.layout.dp_replicate, engine.layout.dp_shard, engine.layout.sp, engine.layout.tp,
                        engine.layout.ep),
            "tp_split": sorted(n for n, p in engine.model.named_parameters()
                               if "tp" in (getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ())),
            "ep_split": {n: tuple(p.to_local().shape) for n, p in engine.model.named_parameters()
                         if "ep" in (getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ())},
        },
        out / f"result_rank{rank}.pt",
    )
    if dist.is_initialized():
        dist.barrier()
    engine.destroy()


if __name__ == "__main__":
    mode = sys.argv[3] if len(sys.argv) > 3 else ""
    run(sys.argv[1], sys.argv[2], lora=mode == "lora", layout=mode)
