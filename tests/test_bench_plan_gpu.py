"""benchmarks/bench_plan_gpu.py's dry run: the GPU validation's every path (prediction, the
measured step, the out-of-memory check, the report) on the CPU with the micro tiny model."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_plan_gpu.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_plan_gpu", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_dry_run_predicts_within_goal_and_confirms_the_out_of_memory(bench, micro_model_dir, capsys):
    result = bench.main(["--dry-run", "--model", str(micro_model_dir)])
    assert _last_json(capsys.readouterr().out) == json.loads(json.dumps(result))
    assert result["measured"] and set(result["errors_pct"]) == set(bench.DRY.cases)
    assert result["max_abs_error_pct"] <= bench.GOAL_PCT, result["errors_pct"]
    # both layouts measured, and checkpointing keeps less at the same length
    assert result["measured_mib"]["ckpt-512"] < result["measured_mib"]["plain-512"]
    oom = result["oom"]
    assert oom["simulated"] and result["oom_confirmed"] and oom["oom_confirmed"]
    assert oom["predicted_mib"] > bench.OOM_MARGIN * oom["capacity_mib"]
    assert oom["tokens"] in bench.DRY.oom_ladder
    assert result["goal_met"]


@pytest.mark.slow
def test_a_case_over_the_card_is_reported_and_misses_the_goal(bench, micro_model_dir, capsys):
    result = bench.main(["--dry-run", "--model", str(micro_model_dir), "--capacity-mib", "10"])
    assert result["measured_mib"]["ckpt-2048"] is None and result["errors_pct"]["ckpt-2048"] is None
    assert result["max_abs_error_pct"] is None and not result["goal_met"]
    assert "out of memory" in capsys.readouterr().out


def test_capacity_guard_raises_torch_out_of_memory(bench):
    with pytest.raises(torch.OutOfMemoryError, match="budget"):
        with bench.CapacityGuard(capacity=4096, resident=1024):
            torch.zeros(256)  # 1 KiB: fits with the resident bytes
            torch.zeros(1024)  # 4 KiB more: over
    with bench.CapacityGuard(capacity=1 << 20, resident=0) as guard:
        kept = torch.zeros(1024)
    assert guard.peak >= kept.nbytes


def test_answers_pack_to_the_micro_batch(bench):
    assert bench.answer_lengths(16384, 8192) == [8192, 8192]
    assert bench.answer_lengths(4096, 8192) == [4096]
    assert bench.answer_lengths(300, 128) == [128, 128, 44]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path of a machine without CUDA")
def test_without_cuda_it_says_so(bench, capsys):
    assert bench.main([]) == {"measured": False, "reason": "no CUDA device"}
    assert "needs a CUDA device" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--capacity-mib", "10"])
