"""On a CUDA machine (skipped elsewhere; `bash ci/gpu_local.sh` runs them with the rest of
the one-GPU check): the embedded server generating on the GPU, and a short asynchronous
GRPO run with the trainer and the embedded server sharing one GPU.

The real-SGLang checks are in tests/test_sglang_protocol.py (`bash ci/gpu.sh MODEL`).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import torch

from arealite.server.app import create_server
from arealite.server.args import ServerArgs
from arealite.server.generate_request import GenerateInput
from arealite.server.sampling import SamplingConfig
from conftest import REPO, run_env

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def _req(rid, ids, **sp):
    return GenerateInput(rid=rid, input_ids=ids, sampling=SamplingConfig(**sp), return_logprob=True)


async def test_embedded_server_on_cuda_matches_an_hf_forward(micro_model_dir):
    srv = create_server(ServerArgs(model_path=str(micro_model_dir), device="cuda", dtype="float32",
                                   random_seed=5, max_batch_size=4))
    try:
        assert srv.device.type == "cuda" and next(srv.model.parameters()).is_cuda
        r = srv.runner
        # Six requests over a batch of four: some wait, join mid-flight and leave early.
        reqs = [_req(f"g{i}", list(range(3, 6 + 3 * i)), max_new_tokens=8 + 5 * i, ignore_eos=True,
                     temperature=0.8 if i % 2 else 1.0) for i in range(6)]
        seqs = await asyncio.gather(*(r.generate(q) for q in reqs))
        for s in seqs:
            assert len(s.output_ids) == s.inp.sampling.max_new_tokens
            ids = torch.tensor([s.inp.input_ids + s.output_ids], device=srv.device)
            with torch.no_grad():
                logits = srv.model(input_ids=ids).logits[0, len(s.inp.input_ids) - 1:-1].float()
            ref = torch.log_softmax(logits / s.inp.sampling.temperature, -1)
            ref = ref.gather(1, torch.tensor(s.output_ids, device=srv.device)[:, None])[:, 0].cpu()
            err = (torch.tensor(s.output_logprobs) - ref).abs().max().item()
            assert err <= 1e-4, (s.inp.rid, err)
    finally:
        srv.runner.shutdown()


@pytest.mark.slow
def test_grpo_with_trainer_and_server_on_one_gpu(tmp_path):
    """The demo's stack on one GPU: weights go by shm (NCCL cannot join two processes on
    one GPU), the trainer computes in float32 like the server so the probe's 1e-3 holds."""
    demo = tmp_path / "demo"
    subprocess.run([sys.executable, "examples/reverse_digits/prepare.py", "--out", str(demo)],
                   cwd=REPO, env=run_env(), check=True, timeout=600, capture_output=True)
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "arealite.train", "--config", "examples/reverse_digits/config.yaml",
           f"experiment.output_root={runs}", "experiment.trial=gpu", f"actor.model_path={demo / 'model'}",
           f"data.train_path={demo / 'train.jsonl'}", f"data.eval_path={demo / 'eval.jsonl'}",
           "data.max_train_steps=20", "launch.n_trainer_procs=1", "weight_sync.method=shm",
           "evaluation.freq_steps=null", "saver.freq_steps=10", "stats.progress_bar=false", "stats.plot=false"]
    res = subprocess.run(cmd, cwd=REPO, env=run_env(), timeout=540, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = runs / "reverse_digits" / "gpu"
    records = [json.loads(x) for x in (run / "stats.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/step_s" in r]
    assert len(steps) == 20
    assert all(r["weight_sync/probe_mean_abs_diff"] <= 1e-3 for r in steps)
    evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    assert evals[-1] >= evals[0]  # 20 steps of the demo's RL do not unlearn
    log = (run / "logs" / "server0.log").read_text()
    assert "device cuda" in log
