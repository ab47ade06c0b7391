"""SGLangClient against the real embedded server (subprocesses, micro model).

Two servers are started once for the module; the SIGKILL test runs last
because it kills one of them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from arealite.api.types import GenerationRequest, SamplingParams
from arealite.config.schema import RolloutConfig
from arealite.inference_client.sglang_client import SGLangClient
from tests.conftest import REPO, free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_servers(micro_model_dir, tmp_path_factory):
    """Two embedded servers on free ports; killed at the end (whatever state they are in)."""
    logs = tmp_path_factory.mktemp("client_e2e_logs")
    env = dict(os.environ, OMP_NUM_THREADS="1", AREALITE_STRICT_SGLANG="1", SGLANG_HEALTH_CHECK_TIMEOUT="5")
    procs = []
    for i in range(2):
        port = free_port()
        log = open(logs / f"server{i}.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "arealite.server", "--model-path", str(micro_model_dir),
             "--host", "127.0.0.1", "--port", str(port), "--random-seed", str(i)],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True,
        )
        procs.append((proc, f"127.0.0.1:{port}", Path(log.name)))
    try:
        yield procs
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def _engine(addrs, **kw) -> SGLangClient:
    cfg = RolloutConfig(request_timeout_s=30, request_retries=3, retry_backoff_s=0.05, **kw)
    return SGLangClient(addrs, cfg, health_probe_interval_s=60)


async def _initialize(eng: SGLangClient, procs) -> None:
    try:
        await eng.initialize(timeout=90)
    except Exception as e:  # show why a server did not come up
        tails = "\n".join(f"--- {p[1]} ---\n{p[2].read_text(errors='replace')[-2000:]}" for p in procs)
        raise AssertionError(f"{e}\n{tails}") from None


async def _server_count(addr: str, name: str) -> int:
    """A counter of the server's ``internal_states`` (from /get_server_info)."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://{addr}/get_server_info") as resp:
            info = await resp.json()
    return sum(st.get(name, 0) for st in info.get("internal_states") or [])


async def _generated(addr: str) -> int:
    """Tokens the server has decoded since it started."""
    return await _server_count(addr, "generated_tokens")


async def _wait_generating(addr: str, target: int, timeout: float = 30) -> None:
    """Wait until the server has decoded ``target`` tokens in all (requests are mid-generation)."""
    deadline = time.monotonic() + timeout
    while await _generated(addr) < target:
        assert time.monotonic() < deadline, f"{addr} did not reach {target} generated tokens in {timeout}s"
        await asyncio.sleep(0.01)


async def test_greedy_is_deterministic_on_real_servers(two_servers):
    addrs = [a for _, a, _ in two_servers]
    async with _engine(addrs) as eng:
        await _initialize(eng, two_servers)
        assert all(eng.server_version(a) == "0.5.23" and eng.supports_weight_update_brackets(a)
                   for a in addrs)
        greedy = SamplingParams(max_new_tokens=12, greedy=True, ignore_eos=True)
        prompt = [5, 17, 42, 99, 7]
        comps = await asyncio.gather(*(eng.agenerate(GenerationRequest(prompt, greedy)) for _ in range(4)))
        assert {c.server for c in comps} == set(addrs)  # round-robin used both servers
        assert all(c.output_ids == comps[0].output_ids for c in comps)
        assert all(c.output_logprobs == pytest.approx(comps[0].output_logprobs, abs=1e-4) for c in comps)
        c = comps[0]
        assert len(c.output_ids) == 12 and c.finish_reason == "length"
        assert c.output_versions == [0] * 12 and all(lp <= 0 for lp in c.output_logprobs)
        # sampling at temperature 1 still returns well-formed completions
        sampled = await eng.agenerate(GenerationRequest(prompt, SamplingParams(max_new_tokens=8)))
        assert 1 <= len(sampled.output_ids) <= 8 and sampled.finish_reason in ("stop", "length")
        assert len(sampled.output_logprobs) == len(sampled.output_versions) == len(sampled.output_ids)


async def test_a_group_goes_as_one_batch_and_shares_its_prompt_on_a_real_server(two_servers):
    """The strict embedded server takes the batch form; the group's prompt runs once there,
    and each sample matches what the same request alone gives (greedy)."""
    addr = two_servers[1][1]
    async with _engine([addr]) as eng:
        await _initialize(eng, two_servers[1:])
        greedy = SamplingParams(max_new_tokens=10, greedy=True, ignore_eos=True)
        prompt = [9, 30, 31, 2, 77, 15]
        alone = await eng.agenerate(GenerationRequest(prompt, greedy))
        shared = await _server_count(addr, "shared_prefill_rows")
        group = await asyncio.gather(*(eng.agenerate(GenerationRequest(prompt, greedy, affinity_key="g"))
                                       for _ in range(4)))
        st = eng.stats()
        assert await _server_count(addr, "shared_prefill_rows") - shared == 3
    assert st["batches"] == 1 and st["batched_requests"] == 4 and st["completed"] == 5
    for c in group:
        assert c.output_ids == alone.output_ids and c.finish_reason == "length"
        assert c.output_logprobs == pytest.approx(alone.output_logprobs, abs=1e-4)


async def test_interrupted_generation_on_a_real_server(two_servers):
    addr = two_servers[0][1]
    async with _engine([addr]) as eng:
        await _initialize(eng, two_servers[:1])
        budget = 300
        sp = SamplingParams(max_new_tokens=budget, greedy=True, ignore_eos=True)
        prompt = [3, 1, 4, 1, 5]
        before = await _generated(addr)
        task = asyncio.create_task(eng.agenerate(GenerationRequest(prompt, sp)))
        await _wait_generating(addr, before + 5)
        assert not task.done(), "generation finished before the pause; raise the budget"
        await eng.pause_generation()
        await eng.begin_weight_update()
        await eng.update_weight_version(1)
        await eng.end_weight_update()
        await eng.continue_generation()
        c = await asyncio.wait_for(task, 60)
        await eng.update_weight_version(0)  # leave the server as found for the next test
    k = c.output_versions.count(0)
    assert c.n_interruptions >= 1 and 0 < k < budget
    assert c.output_versions == [0] * k + [1] * (budget - k)
    assert len(c.output_ids) == budget and c.finish_reason == "length"
    assert c.input_ids == prompt


async def test_sigkill_one_server_mid_batch_every_request_completes(two_servers):
    (victim, a_addr, _), (_, b_addr, _) = two_servers
    async with _engine([a_addr, b_addr]) as eng:
        await _initialize(eng, two_servers)
        sp = SamplingParams(max_new_tokens=100, ignore_eos=True)
        reqs = [GenerationRequest([7 + i, 8, 9], sp) for i in range(32)]
        before = await _generated(a_addr)
        tasks = [asyncio.create_task(eng.agenerate(r)) for r in reqs]
        await _wait_generating(a_addr, before + 100)  # ~1/16 of its share: mid-batch
        assert eng.stats()["servers"][a_addr]["inflight"] > 0
        os.killpg(victim.pid, signal.SIGKILL)
        t0 = time.monotonic()
        comps = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        st = eng.stats()
    assert len(comps) == 32 and all(len(c.output_ids) == 100 for c in comps)
    assert [c.rid for c in comps] == [r.rid for r in reqs]
    moved = [c for c in comps if c.server == b_addr]
    assert len(moved) > 16, "the killed server's requests should have completed on the other one"
    assert st["failed"] == 0 and st["connection_errors"] >= 1 and st["retries"] >= 1
    assert a_addr not in eng.healthy_servers or st["servers"][a_addr]["failed"] > 0
    assert time.monotonic() - t0 < 60
