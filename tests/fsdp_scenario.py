"""Running the scenario of tests/_fsdp_worker.py: under torchrun with 2 or 4 ranks, or in this process.

Shared by the tests that compare a parallel layout with one process (tests/test_fsdp_dist.py,
tests/test_sequence_parallel.py, tests/test_tensor_parallel.py); the one-process result is a
session fixture in conftest (``one_rank_results``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch

from arealite.utils.dist import free_port

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_fsdp_worker.py"


def load_worker():
    """tests/_fsdp_worker.py as a module (its ``run`` in this process is a world of one)."""
    spec = importlib.util.spec_from_file_location("_fsdp_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between two dicts of tensors with the same keys."""
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def torchrun_ranks(model_dir, out: Path, *extra: str, nproc: int = 2, worker: Path = WORKER,
                   result: str = "result_rank{}.pt") -> tuple[Path, list[dict]]:
    """The scenario under ``torchrun --nproc_per_node nproc`` (``extra``: the layout, e.g. lora,
    sp, tp or ``sp=2,tp=2``); each rank's result. ``worker``: another scenario script
    (tests/_critic_worker.py), writing ``result``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(worker), str(model_dir), str(out), *extra,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=360)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return out, [torch.load(out / result.format(r), weights_only=False) for r in range(nproc)]


def two_ranks(model_dir, out: Path, *extra: str, **kwargs) -> tuple[Path, list[dict]]:
    """`torchrun_ranks` with 2 ranks."""
    return torchrun_ranks(model_dir, out, *extra, nproc=2, **kwargs)


#: Every dense family a parallel layout accepts, beside the Qwen2 micro model of the scenario,
#: each built to show what a Qwen2 cannot: Qwen3 normalises each query and key head after its
#: projection (under tensor parallelism a norm every rank holds whole but applies to its own
#: heads only), Llama here has untied embeddings and biases in the attention and the MLP,
#: Mistral a 4:1 GQA ratio and a sliding window (8 tokens) shorter than most rows. Keyword
#: arguments of `arealite.models.tiny.build_tiny_model`.
FAMILIES = {
    "qwen3": dict(family="qwen3"),
    "llama": dict(family="llama", tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
    "mistral": dict(family="mistral", num_attention_heads=8, num_key_value_heads=2, sliding_window=8),
}


def family_runs(family: str, layout: str, tmp_path_factory) -> tuple[dict, dict, dict]:
    """The scenario on ``family``'s micro model, in one process and on 2 ranks of ``layout``
    (sp or tp): ``(single, rank0, rank1)``."""
    from arealite.models.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path_factory.mktemp(f"{family}_model"), size="micro", seed=1,
                                 **FAMILIES[family])
    out = tmp_path_factory.mktemp(f"{family}_1rank")
    load_worker().run(str(model_dir), str(out))
    single = torch.load(out / "result_rank0.pt", weights_only=False)
    _, (r0, r1) = two_ranks(model_dir, tmp_path_factory.mktemp(f"{family}_{layout}2"), layout)
    return single, r0, r1


def assert_matches_one_process(ranks: list[dict], single: dict, tol: float = 1e-5) -> None:
    """The results of a parallel run's ranks (in rank order) equal the 1-process ``single`` within
    ``tol``: every step's loss and gradient norm, the first step's gradients, the weights after
    every kind of step (all ranks exactly alike), the log-probs of each rank's rows; and the
    sharded checkpoint retakes a step exactly."""
    r0 = ranks[0]
    for s2, s1 in zip(r0["stats"] + [r0["redo"]], single["stats"] + [single["redo"]]):
        assert s2["n_tokens"] == s1["n_tokens"] and s2["n_seqs"] == s1["n_seqs"] == 8
        assert abs(s2["loss"] - s1["loss"]) <= tol and abs(s2["grad_norm"] - s1["grad_norm"]) <= tol
    for group in ("seq_mean", "new_losses"):
        for name, s1 in single[group].items():
            assert abs(r0[group][name]["loss"] - s1["loss"]) <= tol, name
            assert abs(r0[group][name]["grad_norm"] - s1["grad_norm"]) <= tol, name
    assert max_diff(r0["grads"], single["grads"]) <= tol
    for other in ranks[1:]:
        assert max_diff(r0["grads"], other["grads"]) == 0.0
        for key in ("after_4", "after_seq_mean", "after_new_losses"):
            assert max_diff(r0[key], other[key]) == 0.0, key
    for key in ("after_4", "after_seq_mean", "after_new_losses"):
        assert max_diff(r0[key], single[key]) <= tol, key
    assert (torch.cat([r["logp"] for r in ranks]) - single["logp"]).abs().max().item() <= tol
    assert max_diff(r0["redone_4"], r0["after_4"]) == 0.0
    assert max_diff(r0["restored_3"], r0["after_4"]) > 1e-6
