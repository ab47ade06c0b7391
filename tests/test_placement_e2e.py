"""`launch.placement` end to end, and the time-shared placement's faults.

- A colocated run and a disaggregated synchronous run from the same seed end with the same
  weights after 3 steps (fp32, CPU, 2 trainer ranks each through `python -m arealite.train`):
  greedy answers with a length reward and no baseline make the rollouts a function of the
  weights alone, so any difference is the time-sharing's (offload, release, wake, push).
  The reference runs as `launch.placement: shared`: with no GPU to split, shared places and
  overlaps exactly as disaggregated does, so the one run is the synchronous disaggregated
  reference and the shared placement's end-to-end run at once.
- A trainer killed while the servers sleep leaves them released and resumable: a real
  embedded server, a real client's admin in a process that dies right after the release,
  and the next trainer's start-up waking exactly what the dead one left asleep.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import REPO, run_env

STEPS = 3


def _train(demo: Path, runs: Path, trial: str, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "arealite.train", "--config", "examples/reverse_digits/config.yaml",
        f"experiment.output_root={runs}", f"experiment.trial={trial}", f"actor.model_path={demo / 'model'}",
        f"data.train_path={demo / 'train.jsonl'}", "data.eval_path=null", "evaluation.freq_steps=null",
        "evaluation.max_prompts=null", f"data.max_train_steps={STEPS}", "rollout.consumer_batch_size=4",
        "generation.n_samples=1", "generation.temperature=0", "algorithm.adv_estimator=none",
        "data.reward_fn=user_pkg.rewards:length_share", "actor.optimizer.lr=1e-3",
        "rollout.max_head_offpolicyness=0", "saver.freq_steps=null", "stats.progress_bar=false",
        "stats.plot=false", *overrides,
    ]
    return subprocess.run(cmd, cwd=REPO, env=run_env(REPO / "tests"), timeout=400, capture_output=True, text=True)


@pytest.mark.slow
def test_colocated_equals_disaggregated_synchronous_after_3_steps(micro_demo_dir, tmp_path):
    runs = tmp_path / "runs"
    for trial, extra in (("disaggregated", ("launch.placement=shared",)), ("colocated", ("launch.placement=colocated",))):
        res = _train(micro_demo_dir, runs, trial, *extra)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = {t: runs / "reverse_digits" / t for t in ("disaggregated", "colocated")}
    a, b = (load_file(str(out[t] / "final_model" / "model.safetensors")) for t in out)
    base = load_file(str(micro_demo_dir / "model" / "model.safetensors"))
    moved = max((a[k].float() - base[k].float()).abs().max().item() for k in base)
    assert moved > 1e-4  # the runs trained: equal weights say something
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff <= 1e-5, diff
    records = [json.loads(x) for x in (out["colocated"] / "stats.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:  # the switch is timed, the push went by tensor and the probe checked it awake
        for key in ("colocation/release_s", "colocation/onload_s", "colocation/offload_s",
                    "colocation/wake_weights_s", "colocation/wake_kv_cache_s", "weight_sync/probe_mean_abs_diff"):
            assert key in r, key
        assert r["weight_sync/probe_mean_abs_diff"] < 1e-3
        assert r["rollout/staleness_max"] == 0
    assert not (out["colocated"] / "servers_asleep.json").exists()  # every release was resumed


_DIE_ASLEEP = """
import asyncio, os, signal, sys
from pathlib import Path
from arealite.config.launch import TimeSharingConfig
from arealite.inference_client.sglang_client import SGLangClient
from arealite.trainer.colocation import TimeSharing
client = SGLangClient([sys.argv[1]])
loop = asyncio.new_event_loop()
loop.run_until_complete(client.initialize(60))
sharing = TimeSharing(TimeSharingConfig(), [], client.admin, loop.run_until_complete, 0, Path(sys.argv[2]))
sharing.trainer_turn()
print("asleep", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _released(url: str) -> list[str]:
    """The memory tags the embedded server holds released (its /server_info)."""
    with urllib.request.urlopen(url + "/server_info", timeout=30) as r:
        return sorted(json.loads(r.read())["internal_states"][0]["memory"]["released"])


def test_a_trainer_killed_while_the_servers_sleep_leaves_them_resumable(tiny_server, tmp_path):
    import asyncio

    from arealite.config.launch import TimeSharingConfig
    from arealite.inference_client.sglang_client import SGLangClient
    from arealite.trainer.colocation import TimeSharing

    addr, asleep = tiny_server.url.removeprefix("http://"), tmp_path / "servers_asleep.json"
    res = subprocess.run([sys.executable, "-c", _DIE_ASLEEP, addr, str(asleep)], cwd=REPO, env=run_env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == -signal.SIGKILL and "asleep" in res.stdout, res.stdout + res.stderr
    assert _released(tiny_server.url) == ["kv_cache", "weights"]
    assert json.loads(asleep.read_text())["tags"] == ["weights", "kv_cache"]

    loop = asyncio.new_event_loop()
    client = SGLangClient([addr])
    loop.run_until_complete(client.initialize(60))
    try:
        sharing = TimeSharing(TimeSharingConfig(), [], client.admin, loop.run_until_complete, 0, asleep)
        sharing.wake_at_start()  # the next trainer: resumes exactly what the file names
        assert _released(tiny_server.url) == []
        assert not asleep.exists() and sharing.asleep == []
        sharing.wake_at_start()  # nothing left asleep: nothing resumed (SGLang dies on a second resume)
        loop.run_until_complete(client.admin.continue_generation())
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
