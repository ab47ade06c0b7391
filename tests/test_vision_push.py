"""Weight pushes of a vision-language model (issue 33): both towers, by the checkpoint's names
(``visual.*``, ``model.layers.*``: what SGLang's Qwen2.5-VL loader takes), by every transfer
method, to a real embedded server, each followed by a read-back of every tensor."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_weight_sync import Weights, _cfg, _publisher, _server_tensor, _start_server, _stop
from test_weight_sync import loop_runner  # noqa: F401  (the event-loop thread fixture)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vision_batches import vision_batch  # noqa: E402

from arealite.config.schema import ActorConfig  # noqa: E402
from arealite.inference_client.sglang_client import SGLangClient  # noqa: E402
from arealite.train_engine.fsdp import FSDPEngine  # noqa: E402
from arealite.weight_sync import DiskTransfer, DistributedTransfer, ShmTransfer  # noqa: E402


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    from arealite.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vl_push") / "model", size="vl-micro", seed=0)


@pytest.fixture(scope="module")
def trained(vl_dir):
    """The engine after one step on a batch with images (both towers moved), and its pushed tensors."""
    engine = FSDPEngine(ActorConfig(model_path=str(vl_dir)), device="cpu").initialize()
    batch = vision_batch(vl_dir)
    engine.train_batch(batch, lambda head, mb: -head.logprobs(mb["labels"]).mean(), lambda mb: 1.0)
    pushed = {n: t.clone() for b in engine.named_weight_buckets(1 << 14) for n, t in b}
    yield engine, pushed
    engine.destroy()


@pytest.fixture(scope="module")
def vl_client(vl_dir, tmp_path_factory, loop_runner):
    proc, addr = _start_server(vl_dir, tmp_path_factory.mktemp("vl_srv") / "server.log")
    run, _ = loop_runner
    client = SGLangClient([addr])
    run(client.initialize(30))
    yield client
    run(client.aclose())
    _stop(proc)


def test_pushed_names_are_the_checkpoints(trained, vl_dir):
    from safetensors.torch import load_file

    _, pushed = trained
    on_disk = load_file(vl_dir / "model.safetensors")
    assert pushed.keys() == on_disk.keys()
    assert "visual.blocks.0.attn.qkv.weight" in pushed and "model.layers.0.self_attn.q_proj.weight" in pushed
    assert not any(".language_model." in n or n.startswith("model.visual.") for n in pushed)
    assert all(pushed[n].shape == on_disk[n].shape for n in pushed)
    for tower in ("visual.", "model.layers."):  # the step moved both towers
        assert not all(torch.equal(pushed[n], on_disk[n]) for n in pushed if n.startswith(tower))


@pytest.mark.parametrize("method", ["distributed", "disk", "shm"])
def test_every_method_pushes_both_towers(method, trained, vl_client, loop_runner, vl_dir, tmp_path):
    run, _ = loop_runner
    engine, pushed = trained
    cfg = _cfg(verify_n_tensors=4, shm_dir=str(tmp_path))
    if method == "distributed":
        transfer = DistributedTransfer(cfg, vl_client.admin, run)
    elif method == "disk":
        transfer = DiskTransfer(cfg, vl_client.admin, run, tmp_path / "scratch", str(vl_dir))
    else:
        transfer = ShmTransfer(cfg, vl_client.admin, run)
    pub = _publisher(transfer, vl_client, run, Weights(engine))
    try:
        pub.publish(1)
        for name, t in pushed.items():
            assert torch.equal(_server_tensor(run, vl_client, name), t.flatten().float()), name
    finally:
        pub.close()
