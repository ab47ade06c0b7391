"""Weight pushes of a vision-language model (issue 33): both towers, by the checkpoint's names
(``visual.*``, ``model.layers.*``: what SGLang's Qwen2.5-VL loader takes), by every transfer
method, to a real embedded server, each followed by a read-back of every tensor."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_weight_sync import _push_and_read_back, _served_client, _trained_engine
from test_weight_sync import loop_runner  # noqa: F401  (the event-loop thread fixture)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vision_batches import vision_batch  # noqa: E402


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    from arealite.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vl_push") / "model", size="vl-micro", seed=0)


@pytest.fixture(scope="module")
def trained(vl_dir):
    """The engine after one step on a batch with images (both towers moved), and its pushed tensors."""
    yield from _trained_engine(vl_dir, vision_batch(vl_dir))


@pytest.fixture(scope="module")
def vl_client(vl_dir, tmp_path_factory, loop_runner):
    yield from _served_client(vl_dir, tmp_path_factory.mktemp("vl_srv") / "server.log", loop_runner)


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
    _push_and_read_back(method, engine, pushed, vl_client, run, vl_dir, tmp_path)


def test_the_probe_scores_images_and_catches_a_wrong_vision_tower(trained, vl_client, loop_runner, vl_dir, tmp_path):
    """After a push of the trainer's weights the probe with an image agrees within 1e-4 (fp32);
    with the server's vision tower alone changed, a text-only probe still agrees and the probe
    with the image fails, naming the mismatch."""
    from test_weight_sync import Weights, _cfg, _publisher
    from vision_batches import png

    from arealite.vision.processor import load_processor
    from arealite.vision.prompt import render_vision_prompt
    from arealite.weight_sync import DiskTransfer, LogprobProbe, WeightSyncError, engine_scorer

    run, _ = loop_runner
    engine, pushed = trained
    processor = load_processor(vl_dir)
    vp = render_vision_prompt(processor, "<image>What does it show?", [png(7, (56, 84))])
    text_ids = processor.tokenizer.encode("What does the picture show? Tell me.")
    call = lambda make_coro, what: run(make_coro())  # noqa: E731

    for version, state in ((1, pushed), (2, {n: t + 0.05 * torch.randn_like(t) if n.startswith("visual.") else t
                                             for n, t in pushed.items()})):
        transfer = DiskTransfer(_cfg(), vl_client.admin, run, tmp_path / f"scratch{version}", str(vl_dir))
        pub = _publisher(transfer, vl_client, run, Weights(state))
        try:
            pub.publish(version)
        finally:
            pub.close()
        text = LogprobProbe(vl_client.admin, engine_scorer(engine), text_ids, tolerance=1e-4)
        image = LogprobProbe(vl_client.admin, engine_scorer(engine, vp), vp.input_ids, tolerance=1e-4,
                             image_data=vp.image_data)
        text.prepare(version)
        image.prepare(version)
        assert text.check_serving(version, call)["probe_max_abs_diff"] < 1e-4
        if version == 1:
            assert image.check_serving(version, call)["probe_max_abs_diff"] < 1e-4
        else:
            with pytest.raises(WeightSyncError, match="log-prob probe mismatch"):
                image.check_serving(version, call)
