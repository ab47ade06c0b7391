"""Composed parallel layouts on 4 ranks against one process (real torchrun, gloo, fp32).

Each layout runs the scenario of tests/_fsdp_worker.py (4 steps, a sharded checkpoint and a
retaken step, log-probs, an export, PPO steps with sequence-level losses) with the 8 rows split
3/2/2/1 over the ranks; the rows have unequal lengths, some odd, so that a model-parallel group's
packed micro-batches do not divide by its size. Losses, gradient norms, first-step gradients and
the weights after every step must be within 1e-5 of one process on the same rows, every rank's
weights alike, and the weights a disk push writes before training the model file's byte for byte.

Every dense family sp x tp accepts runs (Qwen2 ties its embeddings and has attention biases,
Qwen3 normalises each head, Llama here is untied with biases everywhere, Mistral has 8 query
heads on 2 KV heads and a sliding window shorter than the rows); the micro models have 2 KV
heads, fewer than sp x tp = 4 ranks, so Ulysses repeats them.
"""

from __future__ import annotations

import pytest
import torch
from fsdp_scenario import FAMILIES, assert_matches_one_process, load_worker, max_diff, torchrun_ranks

from arealite.config.problems import ConfigProblem
from arealite.train_engine.parallel.layout import ParallelLayout, engine_layout_problems

pytestmark = pytest.mark.timeout(600)

_singles: dict[str, dict] = {}


def _one_process(model_dir, tmp_path_factory) -> dict:
    """The scenario in this process on ``model_dir`` (computed once per model)."""
    key = str(model_dir)
    if key not in _singles:
        out = tmp_path_factory.mktemp("compose_1rank")
        load_worker().run(key, str(out))
        _singles[key] = torch.load(out / "result_rank0.pt", weights_only=False)
    return _singles[key]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, micro_model_dir) -> dict:
    from arealite.models.tiny import build_tiny_model

    dirs = {"qwen2": micro_model_dir}
    for name, kwargs in FAMILIES.items():
        dirs[name] = build_tiny_model(tmp_path_factory.mktemp(f"compose_{name}"), size="micro", seed=1, **kwargs)
    return dirs


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from arealite.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("compose_moe"), size="moe-micro", seed=0)


def _assert_push_is_the_model_file(out, model_dir) -> None:
    from safetensors.torch import load_file

    pushed = {}
    for f in sorted((out / "pushed").glob("*.safetensors")):
        pushed.update(load_file(f))
    on_disk = load_file(model_dir / "model.safetensors")
    assert pushed.keys() == on_disk.keys()
    for name, t in pushed.items():
        assert t.numpy().tobytes() == on_disk[name].numpy().tobytes(), name


def _run(model_dir, layout: str, degrees: tuple, tmp_path_factory) -> None:
    """``layout`` on 4 ranks equals one process; its push is the model file; its export the weights."""
    out, ranks = torchrun_ranks(model_dir, tmp_path_factory.mktemp("compose"), layout, nproc=4)
    assert all(r["degrees"] == degrees for r in ranks)
    assert_matches_one_process(ranks, _one_process(model_dir, tmp_path_factory))
    _assert_push_is_the_model_file(out, model_dir)
    from transformers import AutoModelForCausalLM

    from arealite.utils.checkpoint_names import checkpoint_tensors

    model = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)
    exported = {n: t for name, p in model.state_dict().items() for n, t in checkpoint_tensors(model, name, p)}
    for name, t in ranks[0]["redone_4"].items():
        assert torch.equal(exported[name], t), name


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "mistral"])
def test_parallel_compose_sp2_tp2(family, family_dirs, tmp_path_factory):
    """Tensor parallelism splits the heads over 2 ranks, Ulysses each rank's heads over 2 more."""
    _run(family_dirs[family], "sp=2,tp=2", (1, 1, 2, 2, 1), tmp_path_factory)


@pytest.mark.slow
def test_parallel_compose_dp_replicate2_dp_shard2(micro_model_dir, tmp_path_factory):
    """Hybrid sharding: 2 replicas, each sharding over 2 ranks."""
    _run(micro_model_dir, "dp_replicate=2", (2, 2, 1, 1, 1), tmp_path_factory)


@pytest.mark.slow
def test_parallel_compose_dp_replicate2_sp2(micro_model_dir, tmp_path_factory):
    """Hybrid sharding over sequence-parallel pairs: each replica is one sp group."""
    _run(micro_model_dir, "dp_replicate=2,sp=2", (2, 1, 2, 1, 1), tmp_path_factory)


@pytest.mark.slow
def test_parallel_compose_ep2_sp2(moe_dir, tmp_path_factory):
    """MoE at long context: experts split over 2 of the data x sequence ranks, the routing replayed
    (R3) on each rank's share of the tokens."""
    _run(moe_dir, "ep=2,sp=2", (1, 2, 2, 1, 2), tmp_path_factory)


@pytest.mark.slow
def test_parallel_compose_ep2_tp2(moe_dir, tmp_path_factory):
    """Tensor-parallel attention; each tensor-parallel rank runs the MoE block on half the tokens
    (the routing replayed on its share), its experts split by expert parallelism."""
    _run(moe_dir, "ep=2,tp=2", (1, 2, 1, 2, 2), tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("layout, model", [("sp=2,tp=2", "micro_model_dir"), ("dp_replicate=2,sp=2", "micro_model_dir"),
                                           ("ep=2,tp=2", "moe_dir")])
def test_parallel_compose_critic(layout, model, request, tmp_path_factory):
    """The critic under composed layouts (on the MoE model, a value model whose experts split by
    expert parallelism): the same fresh value head, the same values of each rank's rows, value
    losses, gradient norms and head after three steps as one process (1e-5)."""
    from fsdp_scenario import HERE

    model_dir = request.getfixturevalue(model)
    single = _critic_one_process(model_dir, tmp_path_factory)
    _, ranks = torchrun_ranks(model_dir, tmp_path_factory.mktemp("critic_compose"), layout, nproc=4,
                              worker=HERE / "_critic_worker.py", result="critic_rank{}.pt")
    for r in ranks:
        assert max_diff(r["head"], single["head"]) == 0.0
        assert max_diff(r["head_after"], ranks[0]["head_after"]) == 0.0
    for key in ("first_values", "values"):
        assert (torch.cat([r[key] for r in ranks]) - single[key]).abs().max().item() <= 1e-5, key
    for s4, s1 in zip(ranks[0]["stats"], single["stats"]):
        assert abs(s4["value_loss"] - s1["value_loss"]) <= 1e-5 and abs(s4["grad_norm"] - s1["grad_norm"]) <= 1e-5
    assert max_diff(ranks[0]["head_after"], single["head_after"]) <= 1e-5


def _critic_one_process(model_dir, tmp_path_factory) -> dict:
    import importlib.util

    from fsdp_scenario import HERE

    key = f"critic:{model_dir}"
    if key not in _singles:
        spec = importlib.util.spec_from_file_location("_critic_worker", HERE / "_critic_worker.py")
        worker = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(worker)
        out = tmp_path_factory.mktemp("critic_compose_1rank")
        worker.run(str(model_dir), str(out))
        _singles[key] = torch.load(out / "critic_rank0.pt", weights_only=False)
    return _singles[key]


QWEN3 = {"model_type": "qwen3", "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 64}
MOE = {"model_type": "qwen3_moe", "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
       "num_experts": 8}
VLM = {"model_type": "qwen2_5_vl", "vision_config": {}, "text_config": {**QWEN3, "model_type": "qwen2"}}


def _only(problems: list[ConfigProblem]) -> ConfigProblem:
    assert len(problems) == 1, [p.format() for p in problems]
    return problems[0]


@pytest.mark.parametrize("layout, kwargs, field, words", [
    (ParallelLayout(6, sp=2, tp=2), {}, "actor.sp_size", "does not divide the 6"),
    (ParallelLayout(8, dp_replicate=3), {}, "actor.dp_replicate", "dp_replicate=3"),
    (ParallelLayout(12, sp=3, tp=2), {"hf_config": QWEN3}, "actor.sp_size", "num_attention_heads=8"),
    (ParallelLayout(8, sp=2, tp=4), {"hf_config": QWEN3}, "actor.tp_size", "num_key_value_heads=2"),
    (ParallelLayout(8, tp=2, ep=8), {"hf_config": MOE}, "actor.ep_size", "the 4 ranks expert parallelism"),
    (ParallelLayout(4, ep=2), {"hf_config": QWEN3}, "actor.ep_size", "no experts"),
    (ParallelLayout(4, sp=2, ep=4), {"hf_config": {**MOE, "num_experts": 6}}, "actor.ep_size", "6 experts"),
    (ParallelLayout(4, sp=2, tp=2), {"lora": True}, "actor.tp_size", "LoRA"),
    (ParallelLayout(4, sp=2, ep=2), {"lora": True}, "actor.ep_size", "LoRA"),
    (ParallelLayout(4, tp=2), {"hf_config": VLM}, "actor.tp_size", "vision-language"),
    (ParallelLayout(4, tp=2), {"hf_config": {**QWEN3, "model_type": "gpt2"}}, "actor.tp_size", "'gpt2'"),
])
def test_parallel_compose_refuses_impossible_layouts_naming_the_field(layout, kwargs, field, words):
    problem = _only(layout.problems("actor", **kwargs))
    assert problem.path == field and words in problem.message


def test_parallel_compose_accepts_what_the_peers_compose():
    """verl/AReaL's FSDP2 + Ulysses, torchtitan's dp x cp x tp x ep: none refused."""
    assert ParallelLayout(64, dp_replicate=4, sp=2, tp=2).problems("actor", hf_config=QWEN3) == []
    assert ParallelLayout(16, sp=2, tp=2, ep=4).problems("actor", hf_config=MOE) == []
    assert ParallelLayout(8, dp_replicate=2, sp=2, ep=2).problems("actor", hf_config=MOE) == []
    layout = ParallelLayout(64, dp_replicate=4, sp=2, tp=2)
    assert (layout.dp_shard, layout.dp, layout.group_size, layout.fsdp_size) == (4, 16, 4, 32)


@pytest.mark.parametrize("split, fix", [({"sp_size": 2}, "actor.sp_size=1"), ({"tp_size": 2}, "actor.tp_size=1")])
def test_parallel_compose_router_balance_loss_is_refused_under_sp_or_tp(split, fix):
    """Under sp a forward holds a part of the tokens; under tp each rank routes a part of a MoE
    block's tokens: either way a router's balance is not the micro-batch's."""
    from arealite.config.schema import ActorConfig

    cfg = ActorConfig(model_path="m", ep_size=2, router_aux_loss_coef=0.01, **split)
    problem = _only(engine_layout_problems("actor", cfg, 4, hf_config=MOE))
    assert problem.path == "actor.router_aux_loss_coef" and fix in problem.message


def test_parallel_compose_check_names_the_field_before_anything_starts(tiny_model_dir):
    """`python -m arealite.check` (and every launcher, which loads the config the same way) refuses
    a composed layout the model cannot take, naming the field."""
    from arealite.check import load_run_config
    from arealite.config.loader import ConfigError

    base = [f"actor.model_path={tiny_model_dir}", "launch.n_trainer_procs=8"]
    load_run_config(None, base + ["actor.sp_size=2", "actor.tp_size=2", "actor.dp_replicate=2"], check_paths=False)
    with pytest.raises(ConfigError, match=r"actor.sp_size = 4: actor.sp_size x actor.tp_size = 8 does not divide the model.s num_attention_heads"):
        load_run_config(None, base + ["actor.sp_size=4", "actor.tp_size=2"], check_paths=False)


def test_parallel_compose_engine_built_in_code_names_the_field(micro_model_dir):
    """Built in code, the engine checks the layout against its world before any collective."""
    from arealite.config.schema import ActorConfig
    from arealite.train_engine.fsdp import FSDPEngine

    engine = FSDPEngine(ActorConfig(model_path=str(micro_model_dir), sp_size=2, tp_size=2), device="cpu")
    try:
        with pytest.raises(ValueError, match=r"actor.sp_size = 2: .*does not divide the 1 trainer ranks"):
            engine.initialize()
    finally:
        engine.destroy()


def _sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention over one row, in transformers' attention-function form."""
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2), None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_parallel_compose_views_run_on_the_device(device, micro_model_dir):
    """On one rank (ci/gpu_local.sh runs the CUDA case on its one GPU, over NCCL): the engine's world
    mesh and its named views, Ulysses over a 1-rank group and tensor parallelism over the
    1-rank tp view compute what the plain modules compute, and a step trains."""
    import copy

    from arealite.config.schema import ActorConfig
    from arealite.train_engine.fsdp import FSDPEngine
    from arealite.train_engine.parallel.meshes import WORLD_DIMS
    from arealite.train_engine.parallel.sequence import ulysses_attention
    from arealite.train_engine.parallel.tensor import apply_tensor_parallel
    from transformers import AutoModelForCausalLM

    engine = FSDPEngine(ActorConfig(model_path=str(micro_model_dir), dtype="float32"), device=device).initialize()
    try:
        world = engine.meshes.world
        assert world.mesh_dim_names == WORLD_DIMS and world.device_type == device
        assert engine.meshes.fsdp.mesh_dim_names == ("dp_shard_sp",)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, n, 7, 16, generator=g).to(device) for n in (4, 2, 2))
        split, _ = ulysses_attention(_sdpa, world["dp_shard_sp"].get_group())(None, q, k, v, None)
        whole, _ = _sdpa(None, q, k, v, None)
        assert torch.allclose(split, whole, atol=1e-6)

        hf = AutoModelForCausalLM.from_pretrained(micro_model_dir).to(device)
        layer, plain = hf.model.layers[0], copy.deepcopy(hf.model.layers[0])
        apply_tensor_parallel([layer], world["tp"])
        x = torch.randn(1, 5, hf.config.hidden_size, generator=g).to(device)
        pos = torch.arange(5, device=device)[None]
        emb = hf.model.rotary_emb(x, pos)

        def out(module):
            result = module(x, position_embeddings=emb, position_ids=pos)
            return result[0] if isinstance(result, tuple) else result

        assert torch.allclose(out(layer), out(plain), atol=1e-5)

        from _fsdp_worker import global_batch, n_loss_tokens, token_mean_ce

        batch = {k: t.to(device) for k, t in global_batch(engine.hf_config.vocab_size).items()}
        stats = engine.train_batch(batch, token_mean_ce, n_loss_tokens)
        assert stats["n_seqs"] == 8 and torch.isfinite(torch.tensor(stats["grad_norm"]))
    finally:
        engine.destroy()
