"""Simulated inference servers (``python -m arealite.sim``, ``launch.server_backend: sim``).

The protocol itself is tested by tests/test_sglang_protocol.py, whose backends include
``sim`` (strict mode on). Here: the cost model's arithmetic, the scheduler's behaviour
(continuous batching, KV capacity, pauses, holds, determinism), many servers in one
process, the launcher's command line, and a whole run through ``python -m arealite.train``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml
from conftest import free_port, run_env

from arealite.config.schema import ArealiteConfig
from arealite.server.command_line import check_sim_backend, server_command
from arealite.server.generate_request import GenerateInput
from arealite.server.sampling import SamplingConfig
from arealite.sim.cost_model import SimSpec, load_lengths
from arealite.sim.runner import SimRunner

FAST = dict(time_scale=0.001)


def _runner(spec: SimSpec | None = None, **kw) -> SimRunner:
    args = dict(eos_ids={1}, vocab_size=100, max_batch_size=8, random_seed=0, weight_version="0",
                prompt_cache_entries=16) | kw
    return SimRunner(spec=spec or SimSpec(**FAST), **args)


def _inp(rid: str, ids=(5, 6, 7), **sampling) -> GenerateInput:
    return GenerateInput(rid=rid, input_ids=list(ids), sampling=SamplingConfig(**sampling), return_logprob=True)


# ---------------------------------------------------------------- the cost model


def test_decode_steps_add_up_and_invert():
    spec = SimSpec()
    one = spec.step_s(8, 10_000)
    assert spec.steps_s(1, 8, 10_000) == pytest.approx(one)
    # KV grows by the batch each step: the second step reads 8 more tokens.
    assert spec.steps_s(2, 8, 10_000) == pytest.approx(one + spec.step_s(8, 10_008))
    for t in (0.0, one * 0.5, one * 37.3, 5.0):
        n = spec.steps_within(t, 8, 10_000)
        assert spec.steps_s(n, 8, 10_000) <= t + 1e-12 < spec.steps_s(n + 1, 8, 10_000)


def test_the_h100_7b_numbers_are_plausible():
    spec = SimSpec(gpu="h100", model="7b")
    assert 5e-3 < spec.step_s(1, 0) < 15e-3  # a lone decode step: weights over HBM, ~8 ms
    assert 500_000 < spec.kv_capacity_tokens < 1_500_000
    assert spec.transfer_s() == pytest.approx(7.62e9 * 2 / 25e9)
    with pytest.raises(ValueError, match="--sim-gpus-per-server"):
        SimSpec(gpu="a100", model="32b", mem_fraction=0.5)


def test_lengths_are_long_tailed_and_from_a_file(tmp_path):
    spec = SimSpec(length_median=100, length_sigma=1.0)
    rng = np.random.default_rng(0)
    draws = np.array([spec.draw_length(rng) for _ in range(4000)])
    assert 85 < np.median(draws) < 115 and np.percentile(draws, 99) > 5 * np.median(draws)
    f = tmp_path / "lengths.txt"
    f.write_text("3\n\n7\n")
    assert set(SimSpec(lengths=load_lengths(str(f))).draw_length(rng) for _ in range(50)) == {3, 7}
    f.write_text("3\nx\n")
    with pytest.raises(ValueError, match=r"lengths.txt:2: 'x' is not an integer"):
        load_lengths(str(f))


# ---------------------------------------------------------------- the scheduler


def test_answers_are_deterministic_end_on_eos_and_respect_the_cap():
    async def run(seed: int):
        r = _runner(random_seed=seed)
        outs = await asyncio.gather(*(r.generate(_inp(f"r{i}", max_new_tokens=64)) for i in range(6)),
                                    r.generate(_inp("g", temperature=0.0, max_new_tokens=64)))
        greedy_again = await r.generate(_inp("g2", temperature=0.0, max_new_tokens=64))
        r.shutdown()
        return outs, greedy_again

    outs, again = asyncio.run(run(0))
    same, _ = asyncio.run(run(0))
    other, _ = asyncio.run(run(1))
    assert [s.output_ids for s in outs] == [s.output_ids for s in same]
    assert [s.output_ids for s in outs] != [s.output_ids for s in other]
    assert again.output_ids == outs[-1].output_ids  # greedy: the same prompt, the same answer
    for s in outs:
        assert 1 <= len(s.output_ids) <= 64 and len(s.output_logprobs) == len(s.output_ids)
        assert all(lp <= 0 for lp in s.output_logprobs)
        if s.finish_reason["type"] == "stop":
            assert s.output_ids[-1] == 1 and 1 not in s.output_ids[:-1]
        else:
            assert s.finish_reason == {"type": "length", "length": 64} and len(s.output_ids) == 64


def test_batch_rows_and_kv_capacity_make_requests_wait():
    async def run():
        r = _runner(SimSpec(**FAST, length_median=1000, length_sigma=0.0), max_batch_size=2)
        r.kv_capacity = 2_100  # room for two answers of 1000 tokens and their prompts
        tasks = [asyncio.ensure_future(r.generate(_inp(f"r{i}", max_new_tokens=1000, ignore_eos=True)))
                 for i in range(3)]
        await asyncio.sleep(0.005)
        seen = (r.n_running, r.n_waiting)
        await asyncio.gather(*tasks)
        r.shutdown()
        return seen, r.stats

    (running, waiting), stats = asyncio.run(run())
    assert (running, waiting) == (2, 1)
    assert stats["max_running"] == 2 and stats["generated_tokens"] == 3000


def test_pause_aborts_with_partial_output_and_a_hold_stops_generation():
    async def run():
        r = _runner(SimSpec(time_scale=0.05))
        task = asyncio.ensure_future(r.generate(_inp("long", max_new_tokens=100_000, ignore_eos=True)))
        await asyncio.sleep(0.2)
        hold = asyncio.ensure_future(r.hold(4.0))  # 0.2 s of real time
        await asyncio.sleep(0.05)
        made = r.stats["generated_tokens"]
        await asyncio.sleep(0.1)
        held_still = r.stats["generated_tokens"] == made
        await hold
        n = await r.call(lambda: r.set_paused(True))
        seq = await task
        queued = asyncio.ensure_future(r.generate(_inp("later", max_new_tokens=4)))
        await asyncio.sleep(0.05)
        waiting = r.n_waiting
        await r.call(lambda: r.set_paused(False))
        later = await queued
        r.shutdown()
        return n, seq, held_still, waiting, later, r.stats

    n, seq, held_still, waiting, later, stats = asyncio.run(run())
    assert n == 1 and seq.finish_reason["type"] == "abort" and 0 < len(seq.output_ids) < 100_000
    assert held_still and stats["sim_transfer_s"] == pytest.approx(4.0)
    assert waiting == 1 and later.finish_reason["type"] in ("stop", "length")


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_kept_pauses_finish_the_answer_and_tag_its_tokens_by_version(mode):
    # retract: the answer goes back to the queue and its prompt + tokens so far are prefilled again;
    # in_place: it freezes and decodes on, nothing recomputed. Either way one answer, no abort, and
    # its tokens split by the weight version that made them (SGLang's meta_info.weight_versions).
    from arealite.server.runner_contract import weight_version_spans

    async def run():
        r = _runner(SimSpec(time_scale=0.05))
        task = asyncio.ensure_future(r.generate(_inp("long", max_new_tokens=3000, ignore_eos=True)))
        await asyncio.sleep(0.2)
        n = await r.call(lambda: r.set_paused(True, mode))
        await asyncio.sleep(0.05)  # the step under way completes, as in SGLang's scheduler
        made, waiting = r.stats["generated_tokens"], r.n_waiting
        await asyncio.sleep(0.1)
        frozen = r.stats["generated_tokens"] == made and not task.done()

        def load() -> None:
            r.weight_version = "1"
        await r.call(load)
        await r.call(lambda: r.set_paused(False))
        seq = await task
        r.shutdown()
        return n, made, waiting, frozen, seq, r.stats

    n, made, waiting, frozen, seq, stats = asyncio.run(run())
    assert n == 1 and frozen and seq.finish_reason["type"] == "length" and len(seq.output_ids) == 3000
    assert waiting == (1 if mode == "retract" else 0)
    assert stats.get("reprefill_tokens", 0) == (3 + made if mode == "retract" else 0)
    assert weight_version_spans(seq) == [{"version": "0", "start": 0, "end": made},
                                         {"version": "1", "start": made, "end": 3000}]


# ---------------------------------------------------------------- servers and the launcher


@contextlib.asynccontextmanager
async def serving_sim(argv: list[str]):
    """``serve_sim`` on ``argv`` until the block ends; yields (session, ports, spec) once all answer."""
    import aiohttp

    from arealite.sim.serve import parse_sim_args, serve_sim

    args, spec, ports, _ = parse_sim_args(argv)
    stop = asyncio.Event()
    serving = asyncio.ensure_future(serve_sim(args, spec, ports, stop=stop))
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            try:
                async with s.get(f"http://127.0.0.1:{ports[-1]}/health") as resp:
                    if resp.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
        try:
            yield s, ports, spec
        finally:
            stop.set()
            await serving


def test_many_servers_in_one_process_each_with_its_seed(micro_model_dir):
    ports = [free_port(), free_port(), free_port()]

    async def run():
        outs = []
        async with serving_sim(["--sim", "--model-path", str(micro_model_dir), "--sim-ports",
                                ",".join(map(str, ports)), "--sim-time-scale", "0.01"]) as (s, ports_, _):
            for p in ports_:
                body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 16}, "return_logprob": True}
                async with s.post(f"http://127.0.0.1:{p}/generate", json=body) as resp:
                    outs.append(await resp.json())
                async with s.get(f"http://127.0.0.1:{p}/server_info") as resp:
                    assert (await resp.json())["port"] == p
        return outs

    outs = asyncio.run(run())
    assert len({json.dumps(o["output_ids"]) for o in outs}) == 3  # server i is seeded seed + i


def test_a_weight_load_counts_toward_the_simulated_transfer(micro_model_dir):
    """The real load of the small model is part of the simulated transfer: the route takes the
    simulated time (0.3 s here), and the hold after the load is only what the load left of it."""
    port = free_port()

    async def run():
        async with serving_sim(["--sim", "--model-path", str(micro_model_dir), "--sim-ports", str(port),
                                "--sim-weight-gbps", str(7.62e9 * 2 / 0.3 / 1e9)]) as (s, _, spec):
            start = time.perf_counter()
            body = {"model_path": str(micro_model_dir), "load_format": "auto"}
            async with s.post(f"http://127.0.0.1:{port}/update_weights_from_disk", json=body) as resp:
                assert resp.status == 200, await resp.text()
            took = time.perf_counter() - start
            async with s.get(f"http://127.0.0.1:{port}/server_info") as resp:
                held = (await resp.json())["internal_states"][0]["sim_transfer_s"]
        return spec.transfer_s(), took, held

    transfer, took, held = asyncio.run(run())
    assert transfer == pytest.approx(0.3)
    assert took >= transfer - 0.01
    assert 0 <= held < transfer and took < transfer + 0.5  # not the load plus the whole transfer


def test_launcher_command_and_the_probe_check():
    cfg = ArealiteConfig(launch={"server_backend": "sim"}, actor={"model_path": "/m"},
                         server={"sim": {"gpu": "h200", "time_scale": 0.1}}, weight_sync={"probe": False})
    cmd = server_command(cfg, 1234, index=2)
    assert cmd[1:3] == ["-m", "arealite.sim"] and "--port" in cmd and "--sim" not in cmd
    assert cmd[cmd.index("--sim-gpu") + 1] == "h200" and cmd[cmd.index("--sim-time-scale") + 1] == "0.1"
    assert "--sim-lengths-file" not in cmd
    check_sim_backend(cfg)
    with pytest.raises(ValueError, match="weight_sync.probe=false"):
        check_sim_backend(cfg.model_copy(update={"weight_sync": cfg.weight_sync.model_copy(update={"probe": True})}))


@pytest.mark.slow
def test_a_run_on_simulated_servers_through_the_launcher(micro_demo_dir, tmp_path):
    runs = tmp_path / "runs"
    cfg = {
        "experiment": {"name": "sim", "trial": "t", "output_root": str(runs)},
        "launch": {"n_servers": 2, "n_trainer_procs": 1, "server_backend": "sim"},
        "server": {"sim": {"time_scale": 0.01, "length_median": 6, "length_sigma": 0.5}},
        "rollout": {"consumer_batch_size": 4, "max_head_offpolicyness": 1},
        "generation": {"n_samples": 4, "max_new_tokens": 8},
        "actor": {"model_path": str(micro_demo_dir / "model")},
        "data": {"train_path": str(micro_demo_dir / "train.jsonl"), "eval_path": str(micro_demo_dir / "eval.jsonl"),
                 "reward_fn": "arealite.reward.reverse_digits:reverse_digits_reward", "max_train_steps": 3},
        "saver": {"export_hf_at_end": False},
        "stats": {"progress_bar": False},
        "weight_sync": {"bucket_size_mb": 0.05, "probe": False},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    res = subprocess.run([sys.executable, "-m", "arealite.train", "--config", str(tmp_path / "cfg.yaml")],
                         cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = runs / "sim" / "t"
    steps = [json.loads(x) for x in (run / "stats.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["rollout/n_trajectories"] == 16 and r["weight_sync/total_s"] > 0 for r in steps)
    assert "simulated servers ready" in (run / "logs" / "server0.log").read_text()
