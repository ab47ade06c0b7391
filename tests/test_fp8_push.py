"""FP8 rollout end to end (`server.quantization: fp8`): the trainer quantises every push.

A real embedded server with ``--quantization fp8`` takes each push method (distributed,
disk, shm, tensor) of `make_publisher`: what it holds afterwards reads back bit-identical to the
trainer's quantised tensors, and the log-prob probe (the trainer's forward on FP8-rounded
weights) agrees; a push with one wrong scale is caught by the probe. Config, launcher and
the strict stand-in's refusal of float tensors into FP8 weights are checked without a server.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import RolloutOf, free_port, perturbed_weights
from test_publisher import rollout  # noqa: F401  (the fixture: a client and controller on `server`)

from arealite.config.cross_field_checks import config_advice, config_problems
from arealite.config.schema import ArealiteConfig
from arealite.quant.fp8 import FP8_DTYPE, quantize_blockwise, scale_name
from arealite.server.command_line import judge_server_command, server_command
from arealite.server.fp8_linear import quantize_linears, sglang_fp8_problem
from arealite.server.process import ServerProcess
from arealite.server.weights import model_state
from arealite.utils.checkpoint_names import checkpoint_tensors
from arealite.weight_sync import Fp8Source, StateDictSource, WeightSyncError, make_publisher
from arealite.weight_sync.fp8_push import fp8_rounded_weights

pytestmark = pytest.mark.timeout(240)


class Engine(StateDictSource):
    """A trainer as far as an FP8 push goes: an HF model (the probe rounds it), its weights, a version."""

    def __init__(self, model_dir: Path, state: dict[str, torch.Tensor]):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.model.load_state_dict(state, strict=False)
        self.model.tie_weights()
        super().__init__(self.model)
        # Pushed under the checkpoint's names, as the FSDP engine does (one tensor per expert).
        self.tensors = [pair for n, t in self.tensors for pair in checkpoint_tensors(self.model, n, t)]
        self.config = type("Cfg", (), {"model_path": str(model_dir)})()
        self.version = 0

    def forward(self, batch, post_hook, out_dtype=torch.float32):
        from arealite.train_engine.lm_head import ChunkedHead

        ids = batch["input_ids"]
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits[0, :-1]
        out = torch.zeros(ids.shape, dtype=out_dtype)
        out[0, 1:] = post_hook(ChunkedHead.from_logits(logits), {"labels": ids[0, 1:]})
        return out

    def set_version(self, version: int) -> None:
        self.version = version

    def get_version(self) -> int:
        return self.version


class WrongScale:
    """A push bug: one block scale doubled on the way (the servers hold a wrong weight)."""

    def __init__(self, source):
        self.source = source

    def named_weight_buckets(self, bucket_bytes):
        done = False
        for bucket in self.source.named_weight_buckets(bucket_bytes):
            out = []
            for name, t in bucket:
                if not done and name.endswith("q_proj.weight_scale_inv"):
                    t, done = t * 2, True
                out.append((name, t))
            yield out


@pytest.fixture(scope="module")
def server(micro_model_dir, tmp_path_factory, request):
    """An embedded server with FP8 weights (``rollout`` connects to it)."""
    proc = ServerProcess(micro_model_dir, free_port(), extra_args=["--quantization", "fp8", "--dtype", "float32"],
                         log_path=tmp_path_factory.mktemp("fp8_push") / "server.log", threads=1)
    request.addfinalizer(proc.stop)  # also when it never gets healthy
    return proc.wait_healthy().url.removeprefix("http://")


def _config(tmp_path: Path, method: str, model_dir: Path, **over) -> ArealiteConfig:
    return ArealiteConfig.model_validate({
        "experiment": {"output_root": str(tmp_path), "name": "e", "trial": "t"},
        "actor": {"model_path": str(model_dir)}, "server": {"quantization": "fp8"},
        "weight_sync": {"method": method, "bucket_size_mb": 0.05, "verify_n_tensors": 3, "timeout_s": 30,
                        "shm_dir": str(tmp_path)}, **over})


@pytest.mark.parametrize("method", ["distributed", "disk", "shm", "tensor"])
def test_an_fp8_push_reads_back_bit_identical_and_passes_the_probe(rollout, method, base_state, micro_model_dir,
                                                                  tmp_path):
    client, controller = rollout
    engine = Engine(micro_model_dir, perturbed_weights(base_state, 11))
    before = {n: t.clone() for n, t in engine.tensors}
    pub = make_publisher(_config(tmp_path, method, micro_model_dir), RolloutOf(client, controller), engine)
    pub.init()
    try:
        timings = pub.publish(1)
    finally:
        pub.close()
    sent = dict(pair for bucket in Fp8Source(StateDictSource(before)).named_weight_buckets(1 << 30)
                for pair in bucket)
    assert any(t.dtype == FP8_DTYPE for t in sent.values()) and any(n.endswith("_scale_inv") for n in sent)
    for name, want in sent.items():
        (values,) = controller.run(client.get_weights_by_name(name, 10**6)).values()
        got = torch.tensor(values, dtype=torch.float32).reshape(want.shape)
        assert torch.equal(got, want.float()), name  # every FP8 value is exact in float32
    # The probe's forward used FP8-rounded weights: the server agrees to float round-off.
    assert timings["probe_mean_abs_diff"] < 1e-4
    # ... and the trainer's own weights were put back after it.
    assert all(torch.equal(t, before[n]) for n, t in engine.tensors)


def test_a_wrong_scale_is_caught_by_the_probe(rollout, base_state, micro_model_dir, tmp_path):
    client, controller = rollout
    engine = Engine(micro_model_dir, perturbed_weights(base_state, 12))
    cfg = _config(tmp_path, "disk", micro_model_dir)
    good = make_publisher(cfg, RolloutOf(client, controller), engine)
    bad = type(good)(good.transfer, WrongScale(good.source), good.admin, good.run, parties=good.parties,
                     controller=controller, verifier=good.verifier.verifiers[-1])
    bad.init()
    with pytest.raises(WeightSyncError, match="log-prob probe mismatch"):
        bad.publish(2)
    controller.run(client.continue_generation())
    controller.resume()
    good.init()
    assert good.publish(3)["probe_mean_abs_diff"] < 1e-4  # the correct push of the same weights passes
    good.close()


def test_the_strict_stand_in_refuses_float_tensors_into_fp8_weights(micro_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(micro_model_dir), dtype=torch.float32)
    name = f"{quantize_linears(model)[0]}.weight"
    state = model_state(model)
    assert "SGLang would cast it" in sglang_fp8_problem(state, [(name, torch.bfloat16)])
    assert sglang_fp8_problem(state, [(name, FP8_DTYPE), (scale_name(name), torch.float32)]) is None
    assert sglang_fp8_problem(state, [("model.norm.weight", torch.bfloat16)]) is None


def test_fp8_rounded_weights_round_the_quantised_weights_and_put_them_back(micro_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(micro_model_dir), dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    q_name = next(n for n in before if n.endswith("q_proj.weight"))
    with fp8_rounded_weights(model):
        now = dict(model.named_parameters())
        q, s = quantize_blockwise(before[q_name])
        assert torch.equal(now[q_name], q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[
            :q.shape[0], :q.shape[1]])
        assert torch.equal(now["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_config_passes_fp8_to_the_servers_refuses_lora_and_suggests_the_correction(tmp_path):
    cfg = _config(tmp_path, "disk", tmp_path)
    cmd = server_command(cfg, 1234)
    assert cmd[cmd.index("--quantization") + 1] == "fp8"
    judge = ArealiteConfig.model_validate({**cfg.model_dump(), "agent": {"judge": {"model_path": "j"}}})
    assert "--quantization" not in judge_server_command(judge, 1235)
    assert any("algorithm.mismatch.mode=tis" in a for a in config_advice(cfg))
    corrected = _config(tmp_path, "disk", tmp_path, algorithm={"mismatch": {"mode": "tis"}})
    assert config_advice(corrected) == []
    lora = _config(tmp_path, "disk", tmp_path, actor={"model_path": str(tmp_path), "lora": {"rank": 4}})
    assert [p.path for p in config_problems(lora, check_paths=False)] == ["server.quantization"]
    sglang = _config(tmp_path, "distributed", tmp_path, launch={"server_backend": "sglang"})
    assert "server.model_path" in [p.path for p in config_problems(sglang, check_paths=False)]
    cmd = server_command(sglang, 1234)
    assert cmd[cmd.index("--quantization") + 1] == "fp8"


def test_an_fp8_checkpoint_for_sglang_carries_blocks_scales_and_the_quantization_config(micro_model_dir, tmp_path):
    import json

    from safetensors.torch import load_file

    from arealite.quant.fp8_checkpoint import write_fp8_checkpoint

    dst = write_fp8_checkpoint(micro_model_dir, tmp_path / "fp8")
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}
    tensors = {n: t for f in dst.glob("*.safetensors") for n, t in load_file(str(f)).items()}
    q_name = next(n for n in tensors if n.endswith("q_proj.weight"))
    assert tensors[q_name].dtype == FP8_DTYPE and tensors[scale_name(q_name)].dtype == torch.float32
    assert tensors["model.embed_tokens.weight"].dtype != FP8_DTYPE
    assert (dst / "tokenizer_config.json").is_file() or not (micro_model_dir / "tokenizer_config.json").is_file()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from arealite.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("fp8_moe"), size="moe-micro", seed=0)


def test_fp8_experts_take_a_push_and_routing_replay_reproduces_the_server(moe_dir, tmp_path):
    """Tiny Qwen3-MoE: experts FP8 expert by expert, the router unquantised; after an FP8 push the
    probe agrees, and the trainer replaying the server's routing (R3) on its FP8-rounded weights
    scores the server's tokens as the server did."""
    from arealite.inference_client.sglang_client import SGLangClient
    from arealite.api.types import GenerationRequest, SamplingParams
    from arealite.moe.router_hooks import RoutingCapture, RoutingReplay
    from arealite.rollout.controller import RolloutController

    from arealite.config.schema import RolloutConfig

    proc = ServerProcess(moe_dir, free_port(), extra_args=["--quantization", "fp8", "--dtype", "float32",
                                                           "--enable-return-routed-experts"],
                         log_path=tmp_path / "server.log", threads=1)
    try:
        addr = proc.wait_healthy().url.removeprefix("http://")
        client = SGLangClient([addr], RolloutConfig(request_timeout_s=60))
        controller = RolloutController(client, RolloutConfig()).start(init_timeout=90)
        engine = Engine(moe_dir, perturbed_weights(Engine(moe_dir, {}).model.state_dict(), 13))
        pub = make_publisher(_config(tmp_path, "shm", moe_dir), RolloutOf(client, controller), engine)
        pub.init()
        assert pub.publish(1)["probe_mean_abs_diff"] < 1e-4
        pub.close()
        (router,) = controller.run(client.get_weights_by_name("model.layers.0.mlp.gate.weight", 10**6)).values()
        assert torch.equal(torch.tensor(router), dict(engine.tensors)["model.layers.0.mlp.gate.weight"])
        client.wire.return_routed_experts = True
        c = controller.run(client.agenerate(GenerationRequest([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=6))))
        controller.stop()
    finally:
        proc.stop()
    ids, n = c.all_ids[:-1], len(c.all_ids) - 1
    served = c.routed_experts.view(n, 2, 2)
    with torch.no_grad(), fp8_rounded_weights(engine.model), RoutingReplay(engine.model, served), \
            RoutingCapture(engine.model) as cap:
        logp = torch.log_softmax(engine.model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        assert torch.equal(cap.take(), served)
    mine = logp[len(c.input_ids) - 1:].gather(1, torch.tensor(c.output_ids)[:, None])[:, 0]
    torch.testing.assert_close(mine, torch.tensor(c.output_logprobs), atol=1e-4, rtol=0)


def test_the_config_check_command_prints_the_fp8_correction_advice(capsys):
    from arealite.check import main

    assert main(["--no-paths", "server.quantization=fp8"]) == 0
    assert "algorithm.mismatch.mode=tis" in capsys.readouterr().err
    assert main(["--no-paths", "server.quantization=fp8", "algorithm.mismatch.mode=tis"]) == 0
    assert "advice:" not in capsys.readouterr().err
