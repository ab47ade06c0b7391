"""Ulysses sequence parallelism (``actor.sp_size``): 2 ranks of one sequence-parallel group under
real torchrun (gloo) train and score as 1 process does, and the attention all-to-alls equal
attention over the whole row, forward and backward, with fewer KV heads than ranks.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fsdp_scenario import assert_matches_one_process, family_runs, two_ranks

from arealite.train_engine.parallel.layout import run_layout_problems
from arealite.utils.dist import free_port


@pytest.fixture(scope="module")
def sp_results(micro_model_dir, tmp_path_factory):
    return two_ranks(micro_model_dir, tmp_path_factory.mktemp("sp2"), "sp")


@pytest.mark.slow
def test_sequence_parallel_two_ranks_match_one_process(sp_results, one_rank_results):
    """Every packed micro-batch is split by tokens over the 2 ranks (with an odd token count
    padded): losses, gradient norms, weights after each kind of step and log-probs equal 1 process."""
    _, (r0, r1) = sp_results
    single = one_rank_results
    assert r0["layout"] == (1, 2, 1) and r0["tp_split"] == []
    assert_matches_one_process([r0, r1], single)
    for s2 in r0["stats"]:
        assert s2["mean_logp"] == pytest.approx(-s2["loss"], abs=1e-6)  # the gathered log-probs are the loss's


@pytest.mark.slow
def test_sequence_parallel_matches_one_process_on_qwen3(tmp_path_factory):
    """Qwen3's per-head norms run before Ulysses' all-to-all, on each rank's own tokens: their
    gradients are summed like every other weight's."""
    single, r0, r1 = family_runs("qwen3", "sp", tmp_path_factory)
    assert_matches_one_process([r0, r1], single)


def _gather_tokens(x: torch.Tensor) -> torch.Tensor:
    """Both ranks' ``[T/2, ...]`` concatenated (no gradient)."""
    parts = [torch.empty_like(x) for _ in range(2)]
    dist.all_gather(parts, x.detach().contiguous())
    return torch.cat(parts)


def _ulysses_worker(rank: int, port: int, n_kv: int, result_path: str) -> None:
    """Rank ``rank`` of 2: Ulysses attention on its half of a packed row, against the whole row."""
    from arealite.train_engine.attention import sdpa_loop_attention
    from arealite.train_engine.parallel.sequence import ulysses_attention

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)  # the same full tensors on both ranks
    T, H, d = 14, 4, 8
    cu = torch.tensor([0, 5, 6, 11, 14], dtype=torch.int32)
    q, k, v = (torch.randn(1, h, T, d, dtype=torch.float64) for h in (H, n_kv, n_kv))
    grad_out = torch.randn(1, T, H, d, dtype=torch.float64)
    half = slice(rank * T // 2, (rank + 1) * T // 2)
    local = [t[:, :, half].clone().requires_grad_() for t in (q, k, v)]
    module = torch.nn.Module()
    out, _ = ulysses_attention(sdpa_loop_attention, dist.group.WORLD)(module, *local, None, cu_seq_lens_q=cu)
    (out * grad_out[:, half]).sum().backward()
    whole = _gather_tokens(out[0])
    grads = [_gather_tokens(t.grad[0].transpose(0, 1)) for t in local]
    if rank == 0:
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        ref, _ = sdpa_loop_attention(module, *full, None, cu_seq_lens_q=cu)
        (ref * grad_out).sum().backward()
        torch.save({"out": (whole - ref[0]).abs().max().item(),
                    "grads": [(g - f.grad[0].transpose(0, 1)).abs().max().item() for g, f in zip(grads, full)]},
                   result_path)
    dist.destroy_process_group()


@pytest.mark.parametrize("n_kv", [1, 4])
def test_sequence_parallel_attention_equals_whole_row_attention(n_kv, tmp_path):
    """2 ranks, 4 query heads, packed sequences of 5, 1, 5 and 3 tokens split 7 / 7: with 1 KV head
    (fewer than the ranks: repeated) and with 4 (split), output and q/k/v gradients equal one
    process's within 1e-10 (float64)."""
    out = tmp_path / "diff.pt"
    mp.start_processes(_ulysses_worker, args=(free_port(), n_kv, str(out)), nprocs=2, start_method="spawn")
    diff = torch.load(out)
    assert diff["out"] <= 1e-10
    assert max(diff["grads"]) <= 1e-10


def test_sequence_parallel_config_check_reads_the_model(tiny_model_dir):
    """`python -m arealite.check` runs the layout check on the run's config and model before anything starts."""
    from arealite.check import load_run_config
    from arealite.config.loader import ConfigError

    cfg = load_run_config(None, [f"actor.model_path={tiny_model_dir}", "launch.n_trainer_procs=2",
                                 "actor.sp_size=2"], check_paths=False)
    assert run_layout_problems(cfg) == []
    with pytest.raises(ConfigError, match=r"actor.sp_size = 3.*num_attention_heads=4"):
        load_run_config(None, [f"actor.model_path={tiny_model_dir}", "launch.n_trainer_procs=3",
                               "actor.sp_size=3"], check_paths=False)
