"""Expert parallelism (``actor.ep_size``) and the routers' load-balancing loss, on the tiny MoE.

Two ranks under real torchrun (gloo) split each layer's 8 experts 4 and 4 and exchange tokens by
all-to-all; with routing replay (R3) on, they train, checkpoint, score and push weights as one
process does (the scenario of tests/_fsdp_worker.py, each rank with its own rows).
"""

from __future__ import annotations

import pytest
import torch
from fsdp_scenario import assert_matches_one_process, load_worker, two_ranks

from arealite.train_engine.parallel.experts import expert_parallel_problems
from arealite.train_engine.parallel.layout import ParallelLayout
from arealite.moe.router_hooks import RouterLoadBalance, moe_routers

pytestmark = pytest.mark.timeout(300)

MOE = {"model_type": "qwen3_moe", "num_experts": 8, "num_attention_heads": 4}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from arealite.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("ep_moe"), size="moe-micro", seed=0)


@pytest.fixture(scope="module")
def one_process(moe_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ep_1rank")
    load_worker().run(str(moe_dir), str(out))
    return torch.load(out / "result_rank0.pt", weights_only=False)


@pytest.fixture(scope="module")
def ep_results(moe_dir, tmp_path_factory):
    return two_ranks(moe_dir, tmp_path_factory.mktemp("ep2"), "ep")


@pytest.mark.slow
def test_expert_parallel_two_ranks_match_one_process_with_routing_replay(ep_results, one_process):
    _, (r0, r1) = ep_results
    # Each rank holds half of every layer's experts (8 -> 4), as a DTensor on the expert mesh.
    assert len(r0["ep_split"]) == 2 * 2 and r0["ep_split"] == r1["ep_split"]
    assert all(shape[0] == 4 for shape in r0["ep_split"].values())
    assert one_process["ep_split"] == {}
    # Losses, gradient norms, first step's gradients (expert ones included), weights after steps,
    # log-probs, the checkpoint's retaken step: within 1e-5 of one process (fp32).
    assert any("experts" in name for name in r0["grads"])
    assert_matches_one_process([r0, r1], one_process)


@pytest.mark.slow
def test_expert_parallel_push_and_export_equal_one_process(ep_results, one_process, moe_dir):
    """A disk push from ep=2 (experts gathered from both ranks, one tensor per expert as SGLang's
    Qwen3-MoE loads them) is the model file byte for byte; the export loads as a whole model
    holding the trained weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from arealite.utils.checkpoint_names import checkpoint_tensors

    out, (r0, _) = ep_results
    pushed = {}
    for f in sorted((out / "pushed").glob("*.safetensors")):
        pushed.update(load_file(f))
    on_disk = load_file(moe_dir / "model.safetensors")
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in pushed
    assert pushed.keys() == on_disk.keys() == one_process["initial"].keys()
    for name, t in pushed.items():
        assert t.numpy().tobytes() == on_disk[name].numpy().tobytes(), name
    model = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)
    exported = {n: t for name, p in model.state_dict().items() for n, t in checkpoint_tensors(model, name, p)}
    exported.pop("lm_head.weight", None)  # tied: pushed once, as the embedding
    assert exported.keys() == r0["redone_4"].keys()
    for name, t in r0["redone_4"].items():
        assert torch.equal(exported[name], t), name
        assert (t - one_process["redone_4"][name]).abs().max() <= 1e-5, name


def test_expert_parallel_layout_problems_name_the_field():
    assert expert_parallel_problems("actor", 2, 4, hf_config=MOE) == []
    assert ParallelLayout(4, ep=4).problems("actor", hf_config=MOE) == []
    (odd,) = expert_parallel_problems("actor", 3, 6, hf_config=MOE)
    assert odd.path == "actor.ep_size" and odd.value == 3 and "8 experts" in odd.message
    (world,) = expert_parallel_problems("critic", 2, 3)
    assert world.path == "critic.ep_size" and "data x sequence ranks" in world.message
    (dense,) = expert_parallel_problems("actor", 2, 2, hf_config={"model_type": "qwen2"})
    assert "no experts" in dense.message and "'qwen2'" in dense.message
    (lora,) = ParallelLayout(4, sp=2, ep=2).problems("actor", lora=True, hf_config=MOE)
    assert lora.path == "actor.ep_size" and "LoRA" in lora.message


def test_engine_refuses_expert_parallelism_it_cannot_run(moe_dir, micro_model_dir):
    """Built in code, the engine checks its layout before any collective (a world of one here)."""
    from arealite.config.schema import ActorConfig
    from arealite.train_engine.fsdp import FSDPEngine

    with pytest.raises(ValueError, match=r"actor.ep_size = 2: does not divide the 1 ranks expert parallelism"):
        FSDPEngine(ActorConfig(model_path=str(moe_dir), ep_size=2), device="cpu").initialize()
    engine = FSDPEngine(ActorConfig(model_path=str(micro_model_dir), router_aux_loss_coef=0.1), device="cpu")
    try:
        with pytest.raises(ValueError, match=r"actor.router_aux_loss_coef=0.1: the model has no mixture-of-experts"):
            engine.initialize()
    finally:
        engine.destroy()


def test_load_balancing_loss_is_switchs_and_trains_the_router(moe_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    routers = moe_routers(model)
    seen = []  # each router's (logits, chosen experts), to compute the loss by hand
    handles = [r.register_forward_hook(lambda m, a, out: seen.append((out[0].detach(), out[2]))) for r in routers]
    ids = torch.randint(4, 400, (1, 16), generator=torch.Generator().manual_seed(0))
    with RouterLoadBalance(model) as lb:
        model(input_ids=ids)
    for h in handles:
        h.remove()
    loss = lb.loss()
    by_hand = []
    for logits, chosen in seen:  # E * sum_i (share of pairs routed to i) * (mean probability of i)
        share = torch.stack([(chosen == i).sum() for i in range(8)]).float() / chosen.numel()
        by_hand.append(8 * (share * logits.softmax(-1).mean(0)).sum())
    assert abs(loss.item() - torch.stack(by_hand).mean().item()) < 1e-6 and loss.item() > 1.0
    loss.backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers)
    # A uniform router (zero weights): every probability 1/8, and the loss is exactly 1.
    with torch.no_grad():
        for r in routers:
            r.weight.zero_()
    with torch.no_grad(), RouterLoadBalance(model) as lb:
        model(input_ids=ids)
    assert abs(lb.loss().item() - 1.0) < 1e-6


def test_engine_adds_the_load_balancing_loss_when_asked(moe_dir):
    """``actor.router_aux_loss_coef`` > 0: the step reports the balance and the routers' gradient
    differs from the run without it by the loss's own gradient; the reported loss is unchanged."""
    from arealite.config.schema import ActorConfig
    from arealite.train_engine.fsdp import FSDPEngine

    worker = load_worker()
    runs = {}
    for coef in (0.0, 1.0):
        engine = FSDPEngine(ActorConfig(model_path=str(moe_dir), mb_max_tokens=64, router_aux_loss_coef=coef),
                            device="cpu").initialize()
        try:
            batch = worker.global_batch(engine.hf_config.vocab_size)
            stats = engine.train_batch(batch, worker.token_mean_ce, worker.n_loss_tokens)
            grad = moe_routers(engine.model)[0].weight.grad
            runs[coef] = (stats, (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone())
        finally:
            engine.destroy()
    (plain, g0), (balanced, g1) = runs[0.0], runs[1.0]
    assert "router_aux_loss" not in plain and balanced["router_aux_loss"] >= 1.0 - 1e-6
    assert abs(plain["loss"] - balanced["loss"]) < 1e-6
    assert (g1 - g0).abs().max() > 1e-6
