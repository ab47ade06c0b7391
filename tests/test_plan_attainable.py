"""The planner's attainable speed-up (`arealite.plan.attainable`): what the staleness bound lets a
run reach at each eta on its split, played in virtual time before launch."""

from __future__ import annotations

from pathlib import Path

import pytest

from arealite.config.loader import load_config
from arealite.plan.__main__ import main as plan_main
from arealite.plan.attainable import plan_attainable
from arealite.plan.gpus import parse_gpus
from arealite.plan.run_plan import plan_run

REPO = Path(__file__).resolve().parents[1]
MOE = "examples/planning/qwen3-30b-a3b_16xh100.yaml"


@pytest.fixture(scope="module")
def moe_attainable():
    cfg = load_config(str(REPO / MOE), [f"actor.model_path={REPO}/examples/planning/models/qwen3-30b-a3b"],
                      check_paths=False)
    return plan_attainable(cfg, plan_run(cfg, parse_gpus(cfg.launch.gpus)).throughput)


def test_a_larger_eta_lets_the_run_approach_its_bound_and_never_pass_it(moe_attainable):
    """Groups of 8 answers whose tails run for minutes: the staleness bound, not the split, holds
    this run back at small eta; eta 16 fills the servers."""
    a = moe_attainable
    speedups = [r.speedup for r in a.rows]
    assert [r.eta for r in a.rows] == [1, 2, 4, 8, 16]
    assert all(later > earlier for earlier, later in zip(speedups, speedups[1:]))
    assert all(r.of_bound <= 1.02 for r in a.rows)
    assert a.row(2).of_bound < 0.5 < 0.85 < a.row(16).of_bound
    assert a.row(16).rows_busy > 0.95 > 0.5 > a.row(2).rows_busy
    assert not any(n.startswith("played on") for n in a.notes)  # 4 servers: played whole


def test_the_command_prints_it_with_the_configured_eta_marked(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert plan_main([MOE, "rollout.max_head_offpolicyness=4", "server.sim.length_median=300"]) == 0
    out = capsys.readouterr().out
    assert "attainable under the staleness bound (configured split" in out
    assert "lognormal around 300 tokens" in out
    (marked,) = [line for line in out.splitlines() if "<- configured" in line]
    assert marked.split()[0] == "4"
    assert plan_main([MOE, "--no-attainable"]) == 0
    assert "attainable" not in capsys.readouterr().out


def test_a_split_of_many_servers_is_played_on_a_few_and_says_so(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config(str(REPO / "examples/planning/qwen2.5-7b_8xh100.yaml"),
                      [f"actor.model_path={REPO}/examples/planning/models/qwen2.5-7b", "launch.n_servers=12",
                       "launch.n_trainer_procs=4", "rollout.consumer_batch_size=96"], check_paths=False)
    a = plan_attainable(cfg, plan_run(cfg, parse_gpus("2x8xH100")).throughput, etas=(4,), seeds=1)
    assert (a.server_gpus, a.trainer_gpus) == (12, 4)
    assert a.notes[0].startswith("played on 4 of 12 servers with 32 of 96 groups a step")
