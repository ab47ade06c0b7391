"""The critic's scenario, run under ``torchrun --nproc_per_node 2`` and in one process.

    torchrun --nproc_per_node N tests/_critic_worker.py MODEL_DIR OUT_DIR [sp | tp | LAYOUT]

A value engine (``critic.sp_size`` or ``critic.tp_size`` = 2 on two ranks, a composed ``LAYOUT``
such as ``sp=2,tp=2`` on four (tests/_fsdp_worker.py's `parse_layout`), or a world of one)
scores the rows of the fixed global batch of tests/_fsdp_worker.py (each rank its own rows,
unequal in number and length), takes three clipped value-loss steps towards fixed returns and
scores them again. Rank r writes ``critic_rank{r}.pt``: each step's stats, the values before
and after, and the value head's whole weight.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _fsdp_worker import GLOBAL_B, ROWS, global_batch, parse_layout  # noqa: E402

from arealite.config.schema import CriticConfig  # noqa: E402
from arealite.critic import Critic, ValueEngine  # noqa: E402


def whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def run(model_dir: str, out_dir: str, layout: str = "") -> None:
    degrees = parse_layout(layout)
    cfg = CriticConfig(model_path=model_dir, mb_max_tokens=32, dp_replicate=degrees.get("dp_replicate", 1),
                       sp_size=degrees.get("sp", 1), tp_size=degrees.get("tp", 1), ep_size=degrees.get("ep", 1))
    cfg.optimizer.lr = 1e-3
    cfg.optimizer.gradient_clipping = 0.5
    engine = ValueEngine(cfg, device="cpu").initialize()
    rank, world = engine.rank, engine.world_size
    rows = slice(*ROWS[world][rank])
    full = global_batch(engine.hf_config.vocab_size, seed=3)
    L = full["input_ids"].shape[1]
    target = torch.cos(torch.arange(GLOBAL_B * L, dtype=torch.float32).reshape(GLOBAL_B, L) / 7.0)
    full["returns"] = torch.where(full["loss_mask"], target, torch.zeros(()))
    batch = TensorDict({k: v[rows] for k, v in full.items()}, batch_size=[rows.stop - rows.start])
    critic = Critic(engine, value_clip=0.2)
    head = {n: whole(p) for n, p in engine.model.named_parameters() if n.startswith("score.")}
    first_values = critic.compute_values(batch)
    stats = []
    for _ in range(3):
        batch["values"] = critic.compute_values(batch)
        stats.append(critic.update(batch))
    torch.save({"head": head, "first_values": first_values, "stats": stats,
                "values": critic.compute_values(batch),
                "head_after": {n: whole(p) for n, p in engine.model.named_parameters() if n.startswith("score.")}},
               Path(out_dir) / f"critic_rank{rank}.pt")
    if dist.is_initialized():
        dist.barrier()
    engine.destroy()


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "")
