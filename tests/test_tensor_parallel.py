"""Tensor parallelism (``actor.tp_size``): 2 ranks of one tensor-parallel group under real
torchrun (gloo) train, score and push weights as 1 process does.

The scenario is tests/_fsdp_worker.py (steps, a sharded checkpoint and a retaken step, log-probs,
PPO steps): each rank hands the engine its own rows, and the group computes all of them with the
decoder layers' projections split over the 2 ranks.
"""

from __future__ import annotations

import pytest
import torch
from fsdp_scenario import FAMILIES, assert_matches_one_process, family_runs, two_ranks

from arealite.train_engine.parallel.tensor import tensor_parallel_problems

QWEN2 = {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}


@pytest.fixture(scope="module")
def tp_results(micro_model_dir, tmp_path_factory):
    return two_ranks(micro_model_dir, tmp_path_factory.mktemp("tp2"), "tp")


@pytest.mark.slow
def test_tensor_parallel_two_ranks_match_one_process(tp_results, one_rank_results):
    _, (r0, r1) = tp_results
    single = one_rank_results
    assert r0["layout"] == (1, 1, 2)
    # The projections really are split over the tensor-parallel ranks (7 per layer, with the biases).
    assert len(r0["tp_split"]) == 2 * 10 and all("layers." in n for n in r0["tp_split"])
    assert_matches_one_process([r0, r1], single)


@pytest.mark.slow
def test_tensor_parallel_push_equals_one_process_byte_for_byte(tp_results, one_rank_results, micro_model_dir):
    """The weights a disk transfer writes from a tp=2 trainer (full tensors gathered from the
    shards) are the 1-process trainer's and the model file's, byte for byte."""
    from safetensors.torch import load_file

    out, (r0, _) = tp_results
    pushed = {}
    for f in sorted((out / "pushed").glob("*.safetensors")):
        pushed.update(load_file(f))
    on_disk = load_file(micro_model_dir / "model.safetensors")
    assert pushed.keys() == on_disk.keys() == one_rank_results["initial"].keys()
    for name, t in pushed.items():
        assert t.dtype == on_disk[name].dtype and t.shape == on_disk[name].shape, name
        assert t.numpy().tobytes() == on_disk[name].numpy().tobytes(), name
        assert torch.equal(r0["initial"][name], one_rank_results["initial"][name]), name
    # After training, the gathered weights are those of the 1-process run (checked above) and
    # export loads as a whole Hugging Face model.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)
    for name, t in r0["redone_4"].items():
        assert torch.equal(model.state_dict()[name], t), name


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tp_family_runs(request, tmp_path_factory):
    return request.param, *family_runs(request.param, "tp", tmp_path_factory)


@pytest.mark.slow
def test_tensor_parallel_matches_one_process_for_each_family(tp_family_runs):
    """Losses, gradient norms, first-step gradients and weights after every step within 1e-5 of
    one process, for each family (Qwen3's per-head norms trained on a part of their gradient
    before the norms were summed over the ranks: the gradient norm differed from step 1)."""
    name, single, r0, r1 = tp_family_runs
    if name == "qwen3":
        assert {n.rsplit(".", 2)[-2] for n in r0["tp_split"]} >= {"q_norm", "k_norm"}
    assert_matches_one_process([r0, r1], single)


@pytest.mark.slow
def test_tensor_parallel_splits_a_moe_blocks_tokens(tmp_path_factory):
    """tp=2 on a Qwen3-MoE model without expert parallelism: each rank runs every MoE block on half
    of its tokens (the routing replayed on that half), the router's and the whole experts'
    gradients summed over the two ranks; as one process, within 1e-5."""
    from fsdp_scenario import load_worker

    from arealite.models.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path_factory.mktemp("tp_moe"), size="moe-micro", seed=0)
    out = tmp_path_factory.mktemp("tp_moe_1rank")
    load_worker().run(str(model_dir), str(out))
    single = torch.load(out / "result_rank0.pt", weights_only=False)
    _, (r0, r1) = two_ranks(model_dir, tmp_path_factory.mktemp("tp_moe2"), "tp")
    assert_matches_one_process([r0, r1], single)


def test_tensor_parallel_refuses_a_layer_parameter_it_does_not_know(micro_model_dir):
    """A parameter of the attention the plan neither splits nor knows as per-head is refused."""
    from transformers import AutoModelForCausalLM

    from arealite.train_engine.parallel.tensor import apply_tensor_parallel

    model = AutoModelForCausalLM.from_pretrained(micro_model_dir)
    layer = model.model.layers[0]
    layer.self_attn.register_parameter("sinks", torch.nn.Parameter(torch.zeros(4)))
    with pytest.raises(NotImplementedError, match=r"'self_attn.sinks'.*tp_size=1"):
        apply_tensor_parallel([layer], tp_mesh=None)


def test_engine_names_the_field_when_the_model_cannot_take_the_layout(tmp_path_factory):
    """Built in code on 2 ranks, an engine whose model cannot be split (1 KV head over tp=2)
    raises an error naming the field and the model's size (was a TypeError joining the problems)."""
    from arealite.models.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path_factory.mktemp("tp_kv1"), size="micro", num_key_value_heads=1)
    with pytest.raises(AssertionError, match=r"ValueError: actor.tp_size = 2: does not divide the model's "
                                             r"num_key_value_heads=1"):
        two_ranks(model_dir, tmp_path_factory.mktemp("tp_kv1_run"), "tp")


def test_tensor_parallel_refuses_a_model_it_does_not_know():
    (problem,) = tensor_parallel_problems({**QWEN2, "model_type": "gpt2"}, 2, "actor.tp_size")
    assert problem.path == "actor.tp_size" and problem.value == 2 and "'gpt2'" in problem.message


def test_tensor_parallel_refuses_sizes_that_do_not_divide():
    problems = tensor_parallel_problems({**QWEN2, "num_key_value_heads": 1, "intermediate_size": 130}, 4,
                                        "critic.tp_size")
    assert [p.path for p in problems] == ["critic.tp_size"] * 2
    assert any("num_key_value_heads=1" in p.message for p in problems)
    assert any("intermediate_size=130" in p.message for p in problems)


def test_tensor_parallel_engine_refuses_lora_before_loading(micro_model_dir):
    """An engine built in code checks its layout too, naming the fields, before any process group work."""
    from arealite.config.schema import ActorConfig, LoraConfig
    from arealite.lora import LoraFSDPEngine

    cfg = ActorConfig(model_path=str(micro_model_dir), tp_size=2, lora=LoraConfig(rank=2))
    with pytest.raises(ValueError, match=r"actor.tp_size = 2.*LoRA"):
        LoraFSDPEngine(cfg, device="cpu").initialize()
