"""Mixture-of-experts routing: the tiny MoE, capture on the server, the wire, replay (R3)."""

from __future__ import annotations

import asyncio
import base64
import math
import socket

import pytest
import torch

from arealite.api.types import Completion, GenerationRequest, SamplingParams, validate_trajectory
from arealite.inference_client.errors import AttemptFailure
from arealite.inference_client.moe_routing import RoutingRows
from arealite.inference_client.sglang_wire import SGLangWire
from arealite.moe.router_hooks import RoutingCapture, RoutingReplay, moe_routers
from arealite.moe.trajectory import micro_batch_experts, routed_experts_of
from arealite.moe.wire import decode_routed_experts, encode_routed_experts
from arealite.server.generate_request import RequestError, parse_generate
from arealite.train_engine.packing import pack

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from arealite.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("moe_micro"), size="moe-micro", seed=0)


@pytest.fixture(scope="module")
def moe(moe_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


def test_tiny_moe_is_a_qwen3_moe_that_loads(moe):
    assert type(moe).__name__ == "Qwen3MoeForCausalLM"
    assert moe.config.num_experts == 8 and moe.config.num_experts_per_tok == 2
    assert len(moe_routers(moe)) == moe.config.num_hidden_layers


def test_replaying_the_captured_routing_changes_nothing_and_other_experts_do(moe):
    ids = torch.randint(4, 400, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), RoutingCapture(moe) as cap:
        ref = moe(input_ids=ids).logits
        own = cap.take()
    assert own.shape == (12, 2, 2) and own.dtype == torch.int32
    with torch.no_grad(), RoutingReplay(moe, own):
        assert torch.equal(moe(input_ids=ids).logits, ref)
    other = (own + 1) % 8
    with RoutingReplay(moe, other), RoutingCapture(moe) as cap:  # entered after: sees the replayed ids
        out = moe(input_ids=ids).logits
        assert torch.equal(cap.take(), other)
    assert not torch.allclose(out, ref)
    moe.zero_grad()
    out.sum().backward()
    assert moe_routers(moe)[0].weight.grad.abs().sum() > 0  # the gate learns through the replayed scores
    moe.zero_grad()


def test_minus_one_keeps_the_routers_own_choice(moe):
    ids = torch.randint(4, 400, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), RoutingCapture(moe) as cap:
        ref = moe(input_ids=ids).logits
    with torch.no_grad(), RoutingReplay(moe, torch.full((6, 2, 2), -1)):
        assert torch.equal(moe(input_ids=ids).logits, ref)
    with pytest.raises(ValueError, match="routed_experts has shape"):
        RoutingReplay(moe, torch.zeros(6, 3, 2, dtype=torch.int64))


def _completion(prompt, output, rows):
    return Completion(rid="r", input_ids=prompt, output_ids=output, output_logprobs=[0.0] * len(output),
                      output_versions=[0] * len(output), finish_reason="stop", routed_experts=rows)


def test_trajectory_layout_lines_up_with_packed_tokens():
    # Row t of the server's routing is token t's; after packing, position t must hold it.
    prompt, output = [5, 6, 7], [8, 9]
    rows = torch.arange(4 * 4, dtype=torch.int32).view(4, 4)  # 5 tokens - 1, 2 layers x top-2
    comp = _completion(prompt, output, rows)
    routing = routed_experts_of([comp, _completion([5], [6, 7], torch.zeros(2, 4, dtype=torch.int32))], 5)
    assert routing.shape == (2, 5, 4) and routing.dtype == torch.int16
    assert (routing[0, 0] == -1).all() and torch.equal(routing[0, 1:].int(), rows)
    assert (routing[1, 3:] == -1).all()
    batch = {"input_ids": torch.tensor([prompt + output, [5, 6, 7, 0, 0]]),
             "attention_mask": torch.tensor([[1] * 5, [1, 1, 1, 0, 0]]).bool(), "routed_experts": routing}
    mb, _ = pack(batch, [0, 1], [5, 3])
    experts = micro_batch_experts(mb, top_k=2)
    assert experts.shape == (8, 2, 2)
    assert torch.equal(experts[:4].reshape(4, 4).int(), rows) and (experts[4] == -1).all()
    assert (experts[7] == -1).all()  # last token of the second sequence: no server routing
    assert routed_experts_of([_completion(prompt, output, None)], 5) is None


def test_wire_decodes_what_the_server_encodes_and_refuses_malformed_answers():
    chunks = [torch.arange(2 * 3 * 2).view(2, 3, 2), torch.full((1, 3, 2), 70000)]  # two forwards
    b64 = encode_routed_experts(chunks)
    assert base64.b64decode(b64) == torch.cat(chunks).numpy().astype("<i4").tobytes()  # little-endian, C order
    assert torch.equal(decode_routed_experts(b64), torch.cat(chunks).flatten().to(torch.int32))
    assert decode_routed_experts(encode_routed_experts([])).numel() == 0 and decode_routed_experts(None) is None
    answer = {"output_ids": [5], "meta_info": {"finish_reason": {"type": "stop"},
                                               "output_token_logprobs": [[-0.5, 5, None]]}}
    wire = SGLangWire()
    assert torch.equal(wire.parse_answer({**answer, "meta_info": {**answer["meta_info"], "routed_experts": b64}})
                       .routed_experts, decode_routed_experts(b64))
    for bad, why in ((7, "is a int,"), ("not base64!", "is not valid base64"), ("AAAA", "holds 3 bytes, not a whole number")):
        with pytest.raises(AttemptFailure, match=f"meta_info.routed_experts {why}"):
            wire.parse_answer({**answer, "meta_info": {**answer["meta_info"], "routed_experts": bad}})


def test_routing_rows_keep_each_tokens_first_segment():
    rows = RoutingRows()
    rows.extend(torch.arange(3 * 4, dtype=torch.int32), 3)  # segment 1: 3 tokens run
    rows.extend(torch.full((5 * 4,), 7, dtype=torch.int32), 5)  # resumed: 5 run, the first 3 again
    out = rows.rows()
    assert out.shape == (5, 4)
    assert torch.equal(out[:3].flatten(), torch.arange(12, dtype=torch.int32)) and (out[3:] == 7).all()
    rows.extend(torch.zeros(0, dtype=torch.int32), 6)  # a segment aborted before its first forward
    assert torch.equal(rows.rows(), out)
    with pytest.raises(AttemptFailure, match="ids per token"):
        rows.extend(torch.zeros(6 * 3, dtype=torch.int32), 6)
    assert RoutingRows().rows() is None


def test_request_flag_needs_the_server_flag():
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}, "return_routed_experts": True}
    with pytest.raises(RequestError, match="--enable-return-routed-experts"):
        parse_generate(body, vocab_size=100, context_length=64, encode=None)
    (inp,), _ = parse_generate(body, vocab_size=100, context_length=64, encode=None, routed_experts=True)
    assert inp.return_routed_experts
    with pytest.raises(RequestError, match="return_routed_experts must be true or false"):
        parse_generate({**body, "return_routed_experts": 1}, vocab_size=100, context_length=64, encode=None,
                       routed_experts=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def moe_server(moe_dir, tmp_path_factory):
    """The embedded server on the tiny MoE, recording the routing (what R3 starts)."""
    from arealite.server.process import ServerProcess

    proc = ServerProcess(moe_dir, _free_port(), extra_args=["--enable-return-routed-experts"],
                         log_path=tmp_path_factory.mktemp("moe_server") / "server.log", threads=1)
    try:
        yield proc.wait_healthy()
    finally:
        proc.stop()


def _captured(moe, ids: list[int]) -> torch.Tensor:
    """The routing of ``ids`` in one plain forward, ``[len(ids), layers, k]`` with each token's
    experts sorted (the server reports them in its top-k order)."""
    with torch.no_grad(), RoutingCapture(moe) as cap:
        moe(input_ids=torch.tensor([ids]))
        return cap.take().sort(-1).values


def test_server_returns_the_routing_of_every_forwarded_token(moe_server, moe):
    from arealite.inference_client.sglang_client import SGLangClient

    async def run(url):
        async with SGLangClient([url]) as client:
            client.wire.return_routed_experts = True
            sp = SamplingParams(max_new_tokens=6)
            return await asyncio.gather(*[client.agenerate(GenerationRequest(p, sp))
                                          for p in ([5, 6, 7, 8, 9], [10, 11, 12])])

    for c in asyncio.run(run(moe_server.url)):
        n = len(c.input_ids) + len(c.output_ids) - 1
        assert c.routed_experts.shape == (n, 2 * 2)
        assert torch.equal(c.routed_experts.view(n, 2, 2).sort(-1).values, _captured(moe, c.all_ids[:-1]))


async def _two_turn_agent(client, item):
    """A user question, the model's answer, a tool-like reply from the environment, an answer."""
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    first = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=5)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "The calculator says 5. Answer again."}]
    await client.chat.completions.create(model="policy", messages=msgs, max_tokens=5)
    return 1.0


def test_agent_trajectories_carry_the_servers_routing_and_train_with_r3(moe_dir, moe_server, moe):
    """Through the OpenAI endpoint with the real `openai` client, both row shapes: every token of a
    row but the first takes the routing the server reported for it (a plain forward's, for the
    same tokens), the first and the padding -1; the engine trains on the rows with R3 on."""
    from transformers import AutoTokenizer

    from arealite.agent.workflow import AgentWorkflow
    from arealite.config.schema import ActorConfig, GenerationConfig
    from arealite.inference_client.sglang_client import SGLangClient
    from arealite.train_engine.fsdp import FSDPEngine
    from conftest import RecordingClient

    tok = AutoTokenizer.from_pretrained(moe_dir)

    async def episodes():
        async with SGLangClient([moe_server.url], return_routed_experts=True) as client:
            rec, out = RecordingClient(client), {}
            for rows in ("conversation", "call"):
                wf = AgentWorkflow(_two_turn_agent, tokenizer=tok, rows=rows,
                                   generation=GenerationConfig(n_samples=1, max_new_tokens=5))
                try:
                    out[rows] = await wf.arun_episode(rec, {"prompt_id": 0})
                finally:
                    await (await wf.endpoint()).aclose()
            return out, rec.calls

    tds, calls = asyncio.run(episodes())
    assert len(calls) == 4 and calls[1][0][:len(calls[0][1].all_ids)] == calls[0][1].all_ids  # turn 2 continues turn 1
    conv, per_call = tds["conversation"], tds["call"]
    assert conv.batch_size[0] == 1 and per_call.batch_size[0] == 2
    for td in (conv, per_call):
        validate_trajectory(td)
        for i in range(td.batch_size[0]):
            n = int(td["attention_mask"][i].sum())
            ids = td["input_ids"][i, :n].tolist()
            routing = td["routed_experts"][i]
            assert (routing[0] == -1).all() and (routing[n:] == -1).all()
            got = routing[1:n].view(n - 1, 2, 2).to(torch.int32).sort(-1).values
            assert torch.equal(got, _captured(moe, ids[:-1])), f"row {i}"
    # the conversation row: tokens the first turn ran carry its report, the rest the second turn's
    first, second = calls[0][1], calls[1][1]
    ran = len(first.all_ids) - 1
    assert torch.equal(conv["routed_experts"][0, 1:ran + 1].int(), first.routed_experts)
    assert torch.equal(conv["routed_experts"][0, ran + 1:].int(), second.routed_experts[ran:])

    batch = {k: per_call[k] for k in ("input_ids", "attention_mask", "loss_mask", "routed_experts")}
    engine = FSDPEngine(ActorConfig(model_path=str(moe_dir), mb_max_tokens=256), device="cpu").initialize()
    try:
        engine.routing_replay = "r3"
        logp = engine.forward(batch, lambda head, mb: head.logprobs(mb["labels"]))
        mask = per_call["loss_mask"]
        assert torch.allclose(logp[mask], per_call["logprobs"][mask], atol=1e-4)  # the behaviour log-probs
        stats = engine.train_batch(batch, lambda head, mb: -head.logprobs(mb["labels"]).mean(), lambda mb: 1.0)
        assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    finally:
        engine.destroy()


def test_fsdp_engine_trains_the_moe_and_replays_the_batchs_routing(moe_dir, moe):
    """FSDP2 shards the MoE (decoder_layers, fully_shard, the fused head); with routing_replay r3 the
    forward's log-probs are those of a plain forward routed by the batch's ``routed_experts``."""
    from arealite.config.schema import ActorConfig
    from arealite.train_engine.fsdp import FSDPEngine

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, 400, (2, 9), generator=g)
    other = torch.randint(0, 8, (2, 8, 2, 2), generator=g)  # routing of tokens 0..7 of each row
    routing = torch.full((2, 9, 4), -1, dtype=torch.int16)
    routing[:, 1:] = other.view(2, 8, 4).to(torch.int16)
    batch = {"input_ids": ids, "attention_mask": torch.ones(2, 9, dtype=torch.bool),
             "loss_mask": torch.ones(2, 9, dtype=torch.bool), "routed_experts": routing}

    def label_logp(head, mb):  # the fused log-prob head: no [T, V] logits
        return head.logprobs(mb["labels"])

    engine = FSDPEngine(ActorConfig(model_path=str(moe_dir), mb_max_tokens=64), device="cpu").initialize()
    try:
        own = engine.forward(batch, label_logp)
        engine.routing_replay = "r3"
        replayed = engine.forward(batch, label_logp)
        with torch.no_grad():
            for b in range(2):
                with RoutingReplay(moe, torch.cat([other[b], torch.full((1, 2, 2), -1)])):
                    ref = moe(input_ids=ids[b:b + 1]).logits[0].log_softmax(-1)
                want = ref[:-1].gather(-1, ids[b, 1:, None])[:, 0]
                assert torch.allclose(replayed[b, 1:], want, atol=1e-5)
        assert not torch.allclose(own, replayed, atol=1e-4)
        stats = engine.train_batch(batch, lambda head, mb: -label_logp(head, mb).mean(), lambda mb: 1.0)
        assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    finally:
        engine.destroy()
