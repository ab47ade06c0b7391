"""Weight pushes of a mixture-of-experts model by the checkpoint's names, by every transfer method.

Transformers 5 keeps a Qwen3-MoE layer's experts fused in memory (``mlp.experts.gate_up_proj``
``[E, 2I, H]``); its checkpoint, SGLang's loader and the embedded server's update routes name
each expert's ``mlp.experts.{e}.{gate,up,down}_proj.weight``. The train engine pushes those
names (`arealite.utils.checkpoint_names`), and the embedded server writes them through into its
fused parameters: a real server subprocess, the real transfers (gloo broadcast, disk, shared
memory with and without aliasing), each followed by a read-back of every tensor.
"""

from __future__ import annotations

import pytest
import torch
from test_weight_sync import _push_and_read_back, _served_client, _trained_engine
from test_weight_sync import loop_runner  # noqa: F401  (the event-loop thread fixture)

from arealite.utils.checkpoint_names import checkpoint_views


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from arealite.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe_push"), size="moe-micro", seed=0)


@pytest.fixture(scope="module")
def trained(moe_dir):
    """The engine after one step (its weights differ from the file), and its pushed tensors."""
    ids = torch.randint(5, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    yield from _trained_engine(moe_dir, {"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool)})


@pytest.fixture(scope="module")
def moe_client(moe_dir, tmp_path_factory, loop_runner):
    yield from _served_client(moe_dir, tmp_path_factory.mktemp("moe_srv") / "server.log", loop_runner)


def test_pushed_names_are_the_checkpoints(trained, moe_dir):
    from safetensors.torch import load_file

    _, pushed = trained
    on_disk = load_file(moe_dir / "model.safetensors")
    assert pushed.keys() == on_disk.keys()
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in pushed
    assert not any(n.endswith("gate_up_proj") for n in pushed)
    assert all(pushed[n].shape == on_disk[n].shape for n in pushed)
    assert not all(torch.equal(pushed[n], on_disk[n]) for n in pushed)  # the step moved the weights


def test_checkpoint_views_write_through_to_the_fused_parameter(moe_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    fused = model.model.layers[1].mlp.experts.gate_up_proj
    views = checkpoint_views(model, dict(model.state_dict()))
    inter = views["model.layers.1.mlp.experts.3.gate_proj.weight"].shape[0]
    with torch.no_grad():
        views["model.layers.1.mlp.experts.3.up_proj.weight"].fill_(0.5)
    assert (fused[3, inter:] == 0.5).all() and not (fused[3, :inter] == 0.5).any()


@pytest.mark.parametrize("method", ["distributed", "disk", "shm", "shm_alias"])
def test_every_method_pushes_an_moe_by_checkpoint_names(method, trained, moe_client, loop_runner, moe_dir,
                                                        tmp_path):
    run, _ = loop_runner
    engine, pushed = trained
    _push_and_read_back(method, engine, pushed, moe_client, run, moe_dir, tmp_path)
