"""The planner's cluster, server memory and throughput (`arealite.plan.gpus`, `server_memory`,
`throughput`): --gpus parsing, SGLang's KV pool rule against a hand computation, the embedded
server's capacity against what that server computes for itself, and the GPU split."""

from __future__ import annotations

import asyncio
import json

import pytest

from arealite.config.loader import load_config
from arealite.plan.breakdown import GIB
from arealite.plan.gpus import parse_gpus
from arealite.plan.server_memory import model_size, read_model_config, server_memory
from arealite.plan.throughput import MEASURED_MFU, plan_throughput
from arealite.sim.cost_model import GPUS

pytestmark = pytest.mark.timeout(180)

#: Qwen2.5-7B's config.json (the fields that shape it).
QWEN25_7B = dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                 tie_word_embeddings=False, torch_dtype="bfloat16", rope_theta=1000000.0, rms_norm_eps=1e-6)


def config(*overrides: str):
    return load_config(None, ["actor.model_path=/nonexistent/model", *overrides], check_paths=False)


# ---- --gpus


@pytest.mark.parametrize("text, n, name, per_node", [
    ("8xH100", 8, "h100", 8), ("H200", 1, "h200", 1), ("2x8xH100", 16, "h100", 8), ("4xa100", 4, "a100", 4),
    (" 8XH100 ", 8, "h100", 8), ("2xh100-80GB", 2, "h100", 2), ("8xH800", 8, "h100", 8), ("1xL40S", 1, "l40s", 1),
])
def test_gpus_forms_and_case(text, n, name, per_node):
    c = parse_gpus(text)
    assert (c.n_gpus, c.name, c.gpus_per_node) == (n, name, per_node)
    assert c.spec is GPUS[name]
    assert c.n_nodes == n // per_node


@pytest.mark.parametrize("text", ["8xV100", "tpu-v5"])
def test_unknown_gpu_lists_the_known_ones(text):
    with pytest.raises(ValueError) as e:
        parse_gpus(text)
    for known in ("a100", "h100", "h200", "l40s", "h800"):
        assert known in str(e.value)


@pytest.mark.parametrize("text", ["x8", "8x", "0xH100", "2x0xH100", "8*H100"])
def test_malformed_gpus_are_refused(text):
    with pytest.raises(ValueError, match="--gpus"):
        parse_gpus(text)


def test_memory_override_changes_only_that_card():
    c = parse_gpus("8xA100", memory_gib=40)
    assert c.memory_bytes == 40 * GIB
    assert (c.spec.peak_tflops, c.spec.hbm_gbps) == (GPUS["a100"].peak_tflops, GPUS["a100"].hbm_gbps)
    assert GPUS["a100"].memory_gb == 80.0 and parse_gpus("A100").memory_bytes == 80 * GIB
    with pytest.raises(ValueError, match="gpu-memory-gib"):
        parse_gpus("H100", memory_gib=0)


# ---- SGLang's KV pool, by hand


def qwen25_7b_params() -> int:
    h, inter, layers, kv, vocab = 3584, 18944, 28, 4 * 128, 152064
    attn = (h * h + h) + 2 * (h * kv + kv) + h * h  # q (bias), k and v (bias), o
    layer = attn + 3 * h * inter + 2 * h  # MLP, two norms
    return 2 * vocab * h + layers * layer + h  # embeddings and head untied, final norm


def test_model_size_of_qwen25_7b_is_its_published_count():
    size = model_size(QWEN25_7B)
    assert size.params == qwen25_7b_params() == 7_615_616_512
    assert (size.layers, size.kv_heads, size.head_dim) == (28, 4, 128)


@pytest.mark.parametrize("tp", [1, 2])
def test_sglang_capacity_of_qwen25_7b_on_an_h100_is_sglangs_rule(tp):
    cfg = config("launch.server_backend=sglang", f"server.sglang.tp_size={tp}", "data.max_prompt_len=1024",
                 "generation.max_new_tokens=7168")
    plan = server_memory(cfg, parse_gpus("H100").spec, QWEN25_7B)
    # SGLang 0.5.21 (docs/sglang.md): B = free before the weights load (80 GiB less the 1 GiB the
    # planner assumes for CUDA and NCCL), the pool = B x 0.8 - the GPU's share of bf16 weights,
    # cell = (4 // tp) KV heads x (K 128 + V 128) x 28 layers x 2 bytes.
    before = 79 * GIB
    rest = before - qwen25_7b_params() * 2 // tp - int(before * (1 - 0.8))
    cell = (4 // tp) * 256 * 28 * 2
    tokens = rest // cell
    assert plan.kv_tokens == tokens
    assert tokens == {1: 917_781, 2: 2_101_174}[tp]
    # max_running_requests: tokens / 32768 x 512 held in [2048, 4096], at most tokens // 2.
    assert plan.max_running_requests == 4096
    assert plan.concurrent_answers == tokens // 8192
    assert plan.breakdown.total == pytest.approx(80 * GIB, abs=cell)
    assert plan.fits


def test_sglang_weights_over_the_fraction_are_a_problem_naming_the_field():
    cfg = config("launch.server_backend=sglang", "server.sglang.mem_fraction_static=0.15")
    plan = server_memory(cfg, parse_gpus("H100").spec, QWEN25_7B)
    assert plan.kv_tokens == 0 and plan.concurrent_answers == 0 and not plan.fits
    assert "server.sglang.mem_fraction_static" in plan.problems[0]


def test_sglang_extra_args_are_read():
    cfg = config("launch.server_backend=sglang", "server.sglang.extra_args=[--kv-cache-dtype, fp8_e4m3, "
                 "--max-running-requests=64, --max-total-tokens, 100000]", "generation.max_new_tokens=1000")
    plan = server_memory(cfg, parse_gpus("H100").spec, QWEN25_7B)
    assert plan.kv_tokens == 100_000 and plan.max_running_requests == 64 and plan.concurrent_answers == 64


# ---- the embedded server computes its own capacity


@pytest.fixture(scope="module")
def embedded(micro_model_dir):
    """The plan of a run on the micro model and the embedded server the launcher would start."""
    from arealite.server.command_line import embedded_server_command
    from arealite.server.app import create_server
    from arealite.server.args import parse_args

    cfg = load_config(None, [f"actor.model_path={micro_model_dir}", "server.max_batch_size=3",
                             "server.context_length=100", "data.max_prompt_len=6", "generation.max_new_tokens=8"])
    server = create_server(parse_args(embedded_server_command(cfg, port=1)[3:]))
    yield cfg, server_memory(cfg, parse_gpus("H100").spec), server
    server.runner.shutdown()


def test_embedded_capacity_equals_what_the_server_computes(embedded):
    cfg, plan, server = embedded
    assert plan.kv_tokens == server.runner.max_batch_size * server.context_length == 3 * 100
    assert plan.concurrent_answers == plan.max_running_requests == server.runner.max_batch_size


def test_embedded_kv_bytes_per_token_are_the_servers_cache(embedded):
    import torch

    cfg, plan, server = embedded
    with torch.no_grad():
        cache = server.model(input_ids=torch.arange(1, 8)[None], use_cache=True).past_key_values
    real = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers) // 7
    kv = next(v for k, v in plan.breakdown.parts.items() if k.startswith("KV cache"))
    assert kv == 3 * (6 + 8) * real
    weights = next(v for k, v in plan.breakdown.parts.items() if k.startswith("weights"))
    assert weights == sum(p.nbytes for p in server.model.parameters())


async def test_embedded_runs_the_planned_answers_at_once(embedded):
    from arealite.server.generate_request import GenerateInput
    from arealite.server.sampling import SamplingConfig

    cfg, plan, server = embedded
    reqs = [GenerateInput(rid=f"r{i}", input_ids=[5 + i] * 6,
                          sampling=SamplingConfig(max_new_tokens=8, ignore_eos=True)) for i in range(plan.concurrent_answers + 2)]
    await asyncio.gather(*(server.runner.generate(r) for r in reqs))
    assert server.runner.stats["max_running"] == plan.concurrent_answers


# ---- throughput and the split


def split_of(*overrides: str, mfu=None):
    cfg = config("launch.server_backend=sglang", "rollout.consumer_batch_size=420", "generation.n_samples=1",
                 "data.max_prompt_len=512", *overrides)
    return plan_throughput(cfg, parse_gpus("8xH100"), QWEN25_7B, mfu=mfu)


@pytest.mark.parametrize("overrides, mfu, generation_slower", [
    (("generation.max_new_tokens=16384",), 1.0, True),  # long answers, fast training
    (("generation.max_new_tokens=512",), 0.02, False),  # short answers, slow training
])
def test_the_split_gives_the_slower_side_more_gpus(overrides, mfu, generation_slower):
    plan = split_of(*overrides, mfu=mfu)
    assert (plan.gen_s(4) > plan.train_s(4)) == generation_slower  # on an even split
    assert (plan.server_gpus > plan.trainer_gpus) == generation_slower
    assert plan.server_gpus + plan.trainer_gpus == 8
    best = max(plan.gen_s(plan.server_gpus), plan.train_s(plan.trainer_gpus))
    assert all(best <= max(plan.gen_s(s), plan.train_s(8 - s)) for s in range(1, 8))


def test_servers_come_in_units_of_their_tp_size_and_eta_zero_gains_nothing():
    plan = split_of("server.sglang.tp_size=2", "generation.max_new_tokens=4096", "rollout.max_head_offpolicyness=0")
    assert plan.server_gpus % 2 == 0 and plan.trainer_gpus >= 1
    assert plan.speedup_bound(plan.server_gpus, plan.trainer_gpus) == 1.0
    plan.eta = 4
    g, t = plan.gen_s(plan.server_gpus), plan.train_s(plan.trainer_gpus)
    assert plan.speedup_bound(plan.server_gpus, plan.trainer_gpus) == pytest.approx((g + t) / max(g, t))
    assert plan.mfu == MEASURED_MFU and "bench_mfu" in plan.mfu_source
    assert "speed-up bound at eta=4" in plan.table()


def test_generation_rate_follows_the_cost_model():
    short, long = split_of("generation.max_new_tokens=1024"), split_of("generation.max_new_tokens=16384")
    assert 0 < long.gen_tokens_per_s < short.gen_tokens_per_s  # more KV read per step
    assert long.train_tokens_per_s < short.train_tokens_per_s  # attention grows with the length


# ---- a model directory holding only config.json


@pytest.mark.parametrize("backend", ["embedded", "sglang"])
def test_a_config_only_model_directory_plans(tmp_path, backend):
    d = dict(QWEN25_7B, num_hidden_layers=4, hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000)
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = load_config(None, [f"actor.model_path={tmp_path}", f"launch.server_backend={backend}",
                             "data.max_prompt_len=64", "generation.max_new_tokens=256"], check_paths=False)
    assert read_model_config(cfg) == d
    plan = server_memory(cfg, parse_gpus("H100").spec)
    assert plan.fits and plan.concurrent_answers >= 1 and plan.breakdown.total > 0
    t = plan_throughput(cfg, parse_gpus("2xH100"))
    assert (t.server_gpus, t.trainer_gpus) == (1, 1) and t.gen_tokens_per_s > 0 and t.train_tokens_per_s > 0


def test_a_missing_config_json_names_the_field(tmp_path):
    cfg = load_config(None, [f"actor.model_path={tmp_path}"], check_paths=False)
    with pytest.raises(ValueError, match="actor.model_path"):
        server_memory(cfg, parse_gpus("H100").spec)
