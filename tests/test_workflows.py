"""Workflows: RLVR and multi-turn, first against a scripted engine (exact
expectations), then end to end through the controller, the real client and
the embedded server on the tiny model (real HTTP)."""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest
import torch
from transformers import AutoTokenizer

from arealite.api.types import Completion, validate_trajectory
from arealite.config.schema import GenerationConfig, RolloutConfig
from arealite.reward.math import math_reward
from arealite.workflow.multi_turn import MultiTurnWorkflow, StepResult
from arealite.workflow.rlvr import RLVRWorkflow
from conftest import RecordingClient


@pytest.fixture(scope="module")
def tok(micro_model_dir):
    return AutoTokenizer.from_pretrained(micro_model_dir)


class ScriptedEngine:
    """Answers request k with ``answers[k % len(answers)]`` (tokenized), logprob -0.25, version 5."""

    def __init__(self, tokenizer, answers, end_token: int | None = None):
        self.tok = tokenizer
        self.answers = answers
        self.end = end_token
        self.requests = []

    async def agenerate(self, req):
        k = len(self.requests)
        self.requests.append(req)
        await asyncio.sleep(0)
        out = self.tok.encode(self.answers[k % len(self.answers)], add_special_tokens=False)
        if self.end is not None:
            out.append(self.end)
        return Completion(req.rid, list(req.input_ids), out, [-0.25] * len(out), [5] * len(out), "stop")


def gcfg(n=1, **kw):
    return GenerationConfig(n_samples=n, max_new_tokens=kw.pop("max_new_tokens", 8), **kw)


# ----------------------------------------------------------------- RLVR, scripted


async def test_rlvr_group_shapes_masks_rewards(tok):
    eng = ScriptedEngine(tok, ["#### 2", "so it is 3"])
    wf = RLVRWorkflow(math_reward, gcfg(4), tok)
    item = {"prompt": "What is 1 + 1?", "answer": "2", "prompt_id": 7}
    td = await wf.arun_episode(eng, item)
    validate_trajectory(td)
    assert td["rewards"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert len(set(td["group_id"].tolist())) == 1 and td["prompt_id"].tolist() == [7] * 4
    assert len({r.affinity_key for r in eng.requests}) == 1  # one group -> one server
    prompt_ids = tok.encode(item["prompt"], add_special_tokens=False)
    for row in range(4):
        out = tok.encode(["#### 2", "so it is 3"][row % 2], add_special_tokens=False)
        n = len(prompt_ids) + len(out)
        assert td["input_ids"][row, :n].tolist() == prompt_ids + out
        assert td["loss_mask"][row].tolist() == [False] * len(prompt_ids) + [True] * len(out) + [False] * (td["input_ids"].shape[1] - n)
        assert (td["versions"][row][td["loss_mask"][row]] == 5).all()
        assert (td["versions"][row][~td["loss_mask"][row]] == -1).all()
        assert torch.allclose(td["logprobs"][row][td["loss_mask"][row]], torch.tensor(-0.25))
    # EOS always stops a sample
    assert tok.eos_token_id in eng.requests[0].sampling.stop_token_ids


async def test_rlvr_chat_template_prompt(tok):
    eng = ScriptedEngine(tok, ["#### 1"])
    wf = RLVRWorkflow(math_reward, gcfg(1), tok, apply_chat_template=True)
    await wf.arun_episode(eng, {"prompt": "hi", "answer": 1})
    expected = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    assert eng.requests[0].input_ids == expected


def _raises(*a, **k):
    raise ValueError("reward bug")


def _hangs(*a, **k):
    time.sleep(30)


@pytest.mark.parametrize(
    "fn",
    [_raises, _hangs, lambda *a, **k: float("nan"), lambda *a, **k: "1.0"],
    ids=["raises", "hangs", "nan", "string"],
)
@pytest.mark.parametrize("policy", ["zero", "reject"])
async def test_rlvr_reward_errors_are_counted_and_handled(tok, fn, policy):
    rc = RolloutConfig(reward_timeout_s=0.3, on_reward_error=policy)
    wf = RLVRWorkflow(fn, gcfg(2), tok, rc)
    t0 = time.monotonic()
    td = await wf.arun_episode(ScriptedEngine(tok, ["#### 1"]), {"prompt": "q", "answer": 1})
    assert time.monotonic() - t0 < 3
    assert wf.stats()["reward_errors"] == 2
    if policy == "zero":
        assert td["rewards"].tolist() == [0.0, 0.0]
    else:
        assert td is None and wf.stats()["reward_rejected_groups"] == 1


async def test_rlvr_dumps_texts_per_version(tok, tmp_path):
    wf = RLVRWorkflow(math_reward, gcfg(3), tok, RolloutConfig(dump_dir=str(tmp_path)))
    await wf.arun_episode(ScriptedEngine(tok, ["#### 4"]), {"prompt": "2+2?", "answer": 4, "prompt_id": 1})
    lines = [json.loads(x) for x in (tmp_path / "version_5.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and lines[0]["completion"] == "#### 4" and lines[0]["reward"] == 1.0


def test_rlvr_bad_arguments(tok):
    with pytest.raises(TypeError, match="reward_fn"):
        RLVRWorkflow("nope", gcfg(), tok)


async def test_rlvr_item_without_prompt_names_the_field(tok):
    wf = RLVRWorkflow(math_reward, gcfg(), tok)
    with pytest.raises(KeyError, match="'prompt'"):
        await wf.arun_episode(ScriptedEngine(tok, ["1"]), {"question": "x"})


# ------------------------------------------------------------ multi-turn, scripted


async def test_multi_turn_token_in_token_out(tok):
    eng = ScriptedEngine(tok, ["#### 3", "#### 4", "#### 2"])
    wf = MultiTurnWorkflow(math_reward, gcfg(1), tok, max_turns=3, turn_discount=0.5, feedback="wrong")
    td = await wf.arun_episode(eng, {"prompt": "1+1?", "answer": 2})
    validate_trajectory(td)
    piece = wf.user_turn_piece("wrong")
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "1+1?"}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    outs = [tok.encode(a, add_special_tokens=False) for a in ["#### 3", "#### 4", "#### 2"]]
    expected = prompt + outs[0] + piece + outs[1] + piece + outs[2]
    assert td["input_ids"][0].tolist() == expected
    mask = [False] * len(prompt) + [True] * len(outs[0]) + [False] * len(piece) + [True] * len(outs[1]) + [False] * len(piece) + [True] * len(outs[2])
    assert td["loss_mask"][0].tolist() == mask
    # every turn's request is exactly the conversation so far: nothing re-tokenized
    assert [r.input_ids for r in eng.requests] == [prompt, prompt + outs[0] + piece, prompt + outs[0] + piece + outs[1] + piece]
    assert td["rewards"].item() == pytest.approx(1.0 * 0.5**2)
    assert (td["n_steps"].item(), td["step_id"].item()) == (3, 2)
    # the piece is the template's: close the turn, a user turn, open the assistant
    assert tok.decode(piece) == "<|im_end|>\n<|im_start|>user\nwrong<|im_end|>\n<|im_start|>assistant\n"


async def test_multi_turn_does_not_duplicate_the_end_of_turn_token(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    eng = ScriptedEngine(tok, ["#### 9"], end_token=im_end)
    wf = MultiTurnWorkflow(math_reward, gcfg(1), tok, max_turns=2, feedback="no")
    td = await wf.arun_episode(eng, {"prompt": "x", "answer": 2})
    ids = td["input_ids"][0].tolist()
    assert [i for i in range(len(ids) - 1) if ids[i] == ids[i + 1] == im_end] == []
    assert eng.requests[1].input_ids[-len(wf.user_turn_piece("no")) + 1 :] == wf.user_turn_piece("no")[1:]
    assert td["rewards"].item() == 0.0 and td["n_steps"].item() == 2


async def test_multi_turn_per_step_rows(tok):
    rewards = iter([0.1, 0.2, 0.7])

    async def env(item, text, ids, turn):
        r = next(rewards)
        return StepResult(r, done=turn == 2, feedback=f"step {turn} done")

    eng = ScriptedEngine(tok, ["a", "bb", "ccc"])
    wf = MultiTurnWorkflow(None, gcfg(1), tok, env=env, per_step=True, max_turns=5)
    td = await wf.arun_episode(eng, {"prompt": "go"})
    validate_trajectory(td)
    assert td.batch_size[0] == 3
    assert td["rewards"].tolist() == pytest.approx([0.1, 0.2, 0.7])
    assert td["step_id"].tolist() == [0, 1, 2] and td["n_steps"].tolist() == [3, 3, 3]
    assert len(set(td["traj_id"].tolist())) == 1
    for k in range(3):
        out = tok.encode(["a", "bb", "ccc"][k], add_special_tokens=False)
        n = len(eng.requests[k].input_ids)
        # the row is this step's context (not trained on) plus this step's tokens (trained on)
        assert td["input_ids"][k, : n + len(out)].tolist() == eng.requests[k].input_ids + out
        assert td["loss_mask"][k].nonzero().flatten().tolist() == list(range(n, n + len(out)))


def test_multi_turn_bad_arguments(tok):
    with pytest.raises(ValueError, match="max_turns"):
        MultiTurnWorkflow(math_reward, gcfg(), tok, max_turns=0)
    with pytest.raises(ValueError, match="reward_fn"):
        MultiTurnWorkflow(None, gcfg(), tok)


# ------------------------------------------------------- built from a run's config


async def scripted_env(item, text, ids, turn):
    return StepResult(0.25 * (turn + 1), done=turn == 1, feedback="more")


def test_builtin_workflows_build_by_keyword_as_config_does(tok):
    """The constructor convention: ``Workflow(*, tokenizer, generation, rollout, reward_fn, **workflow_kwargs)``."""
    rc = RolloutConfig(on_reward_error="reject", reward_timeout_s=3)
    wf = RLVRWorkflow(tokenizer=tok, generation=gcfg(3), rollout=rc, reward_fn=math_reward, prompt_key="q")
    assert (wf.generation.n_samples, wf.prompt_key, wf.scorer.reject_on_error) == (3, "q", True)
    mt = MultiTurnWorkflow(tokenizer=tok, generation=gcfg(2), rollout=rc, reward_fn=math_reward, max_turns=4)
    assert (mt.generation.n_samples, mt.max_turns, mt.scorer.runner.timeout_s) == (2, 4, 3)


async def test_builtin_workflows_from_config(tok):
    from arealite.config.schema import ArealiteConfig

    cfg = ArealiteConfig(generation={"n_samples": 2, "max_new_tokens": 8},
                         rollout={"on_reward_error": "reject"},
                         data={"prompt_key": "question", "apply_chat_template": True,
                               "reward_fn": "arealite.reward.math:math_reward"})
    wf = RLVRWorkflow.from_config(cfg, tok)
    assert (wf.prompt_key, wf.apply_chat_template, wf.reward_fn, wf.generation.n_samples) == ("question", True, math_reward, 2)
    eng = ScriptedEngine(tok, ["#### 2"])
    td = await wf.arun_episode(eng, {"question": "1+1?", "answer": 2})
    assert td["rewards"].tolist() == [1.0, 1.0]
    mt = MultiTurnWorkflow.from_config(cfg, tok, max_turns=2)
    assert (mt.max_turns, mt.turn_discount, mt.prompt_key, mt.reward_fn) == (2, 0.9, "question", math_reward)
    # an environment named in YAML as module:function
    mt = MultiTurnWorkflow.from_config(cfg, tok, env=f"{__name__}:scripted_env", per_step=True)
    assert mt.env is scripted_env and mt.reward_fn is None
    td = await mt.arun_episode(ScriptedEngine(tok, ["a"]), {"question": "go"})
    assert td["rewards"].tolist() == [0.25, 0.5, 0.25, 0.5] and td["step_id"].tolist() == [0, 1, 0, 1]


def test_modules_keep_to_their_rooms():
    """types knows no workflow; multi-turn does not import RLVR; the workflow base holds no thread pool."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import arealite.api.types\n"
        "assert not [m for m in sys.modules if m.startswith('arealite.workflow')], 'types imports workflow'\n"
        "import arealite.workflow.multi_turn\n"
        "assert 'arealite.workflow.rlvr' not in sys.modules, 'multi_turn imports rlvr'\n"
        "import arealite.workflow.base as base\n"
        "assert 'RewardRunner' not in vars(base) and 'threading' not in vars(base)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


# ------------------------------------------------- trajectory schema and builders


def _good_td(B=2, L=5):
    from tensordict import TensorDict

    am = torch.ones(B, L, dtype=torch.bool)
    am[1, -1] = False
    lm = torch.zeros(B, L, dtype=torch.bool)
    lm[:, 2:4] = True
    return TensorDict({
        "input_ids": torch.arange(B * L).view(B, L), "attention_mask": am, "loss_mask": lm,
        "logprobs": torch.zeros(B, L), "versions": torch.full((B, L), -1), "rewards": torch.tensor([1.0, 0.0]),
        "group_id": torch.zeros(B, dtype=torch.int64), "extra": torch.zeros(B, 3),
    }, batch_size=[B])


@pytest.mark.parametrize("break_it, message", [
    (lambda td: td.exclude("versions"), "missing key 'versions'"),
    (lambda td: td.set("logprobs", td["logprobs"].double()), "'logprobs' has dtype torch.float64"),
    (lambda td: td.set("attention_mask", td["attention_mask"].long()), "'attention_mask' has dtype torch.int64"),
    (lambda td: td.set("versions", torch.zeros(2, 4, dtype=torch.int64)), "'versions' has length 4"),
    (lambda td: td.set("logprobs", torch.zeros(2, 5, 1)), r"'logprobs' has shape \(2, 5, 1\)"),
    (lambda td: td.set("rewards", torch.zeros(2, 1)), r"'rewards' has shape \(2, 1\), expected \[B=2\]"),
    (lambda td: td.set("group_id", {"a": torch.zeros(2)}), "'group_id' holds a TensorDict"),
    (lambda td: td.set("loss_mask", torch.ones(2, 5, dtype=torch.bool)), "'loss_mask' marks tokens outside"),
    (lambda td: td.set("rewards", torch.tensor([1.0, float("nan")])), "'rewards' holds NaN or inf"),
    (lambda td: td.set("rewards", torch.tensor([float("-inf"), 0.0])), "'rewards' holds NaN or inf"),
    (lambda td: td.to_dict(), "expected a TensorDict"),
], ids=["missing", "dtype", "mask-dtype", "length", "3d", "row-shape", "nested", "loss-outside", "nan", "inf", "dict"])
def test_validate_trajectory_names_the_broken_key(break_it, message):
    from arealite.api.types import TrajectoryError

    validate_trajectory(_good_td())  # the intact one passes, extra keys included
    with pytest.raises(TrajectoryError, match=message):
        validate_trajectory(break_it(_good_td()), where="wf")


def test_validate_trajectory_checks_every_reward_of_a_large_batch():
    from arealite.api.types import TrajectoryError
    from tensordict import TensorDict

    B = 1000  # past the pure-Python path: the tensor path must catch it too
    td = TensorDict({k: v.expand(B, *v.shape[1:]).clone() for k, v in _good_td()[:1].items()}, batch_size=[B])
    validate_trajectory(td)
    td["rewards"][B - 1] = float("nan")
    with pytest.raises(TrajectoryError, match="NaN"):
        validate_trajectory(td)


def test_group_builder_matches_rows_padded_and_stacked():
    from arealite.workflow.base import group_from_outputs, pad_and_stack, trajectory_row

    prompt = [11, 12, 13]
    outs = [([5, 6], [-0.5, -0.25], [3, 4]), ([], [], []), ([7, 8, 9, 10], [-1.0, -2.0, -3.0, -4.0], [4, 4, 4, 5])]
    per_row = {"rewards": torch.tensor([1.0, 0.0, 0.5]), "group_id": torch.zeros(3, dtype=torch.int64)}
    fast = group_from_outputs(prompt, outs, dict(per_row))
    ref = pad_and_stack([trajectory_row(prompt, [o]) for o in outs], dict(per_row))
    validate_trajectory(fast)
    assert fast.batch_size == ref.batch_size and set(fast.keys()) == set(ref.keys())
    for k in ref.keys():
        assert fast[k].dtype == ref[k].dtype and torch.equal(fast[k], ref[k]), k
    assert fast["attention_mask"].sum(1).tolist() == [5, 3, 7]
    # equal lengths take the no-padding path
    same = group_from_outputs(prompt, [outs[0], outs[0]], {"rewards": torch.zeros(2), "group_id": torch.zeros(2, dtype=torch.int64)})
    assert same["attention_mask"].all() and same["input_ids"].tolist() == [prompt + [5, 6]] * 2
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        group_from_outputs(prompt, [([5, 6], [-0.5], [3, 4])], per_row)


# ---------------------------------------------------- end to end, real HTTP server


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def make_controller(server, wrap=None, **cfg):
    """A started controller on `server`'s client (wrapped by `wrap`, e.g. a `Recorder`)."""
    from arealite.inference_client.sglang_client import SGLangClient
    from arealite.rollout.controller import RolloutController

    rc = RolloutConfig(**{"consumer_batch_size": 4, "max_head_offpolicyness": 1, **cfg})
    client = SGLangClient([server.url], rc)
    return RolloutController(wrap(client) if wrap else client, rc).start(init_timeout=60), rc


@pytest.mark.slow
def test_rlvr_end_to_end_through_controller(server, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ctl, rc = make_controller(server)
    try:
        wf = RLVRWorkflow(math_reward, gcfg(2, max_new_tokens=6, temperature=1.0), tokenizer, rc, apply_chat_template=True)
        items = [{"prompt": f"What is {i} + 1?", "answer": i + 1, "prompt_id": i} for i in range(4)]
        batch = ctl.rollout_batch(items, wf)
        validate_trajectory(batch)
        assert batch.batch_size[0] == 8
        assert sorted(batch["prompt_id"].tolist()) == [0, 0, 1, 1, 2, 2, 3, 3]
        for g in batch["group_id"].unique():
            assert (batch["group_id"] == g).sum() == 2
        gen = batch["loss_mask"]
        n_gen = gen.sum(1)
        assert ((n_gen >= 1) & (n_gen <= 6)).all()
        assert (batch["versions"][gen] == 0).all() and (batch["versions"][~gen] == -1).all()
        assert (batch["logprobs"][gen] <= 0).all() and (batch["logprobs"][~gen] == 0).all()
        assert set(batch["rewards"].tolist()) <= {0.0, 1.0}
        # generated tokens sit right after the prompt, inside the attention mask
        assert (batch["loss_mask"] <= batch["attention_mask"]).all()
        st = ctl.stats()
        assert st["accepted"] == 4 and st["failed"] == 0 and st["staleness_hist"] == {0: 8}
    finally:
        ctl.stop()


@pytest.mark.slow
def test_multi_turn_end_to_end_token_in_token_out(server, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ctl, rc = make_controller(server, wrap=RecordingClient, consumer_batch_size=2)
    try:
        rec = ctl.client  # workflows reach the client through the controller
        never_right = lambda *a, **k: 0.0  # noqa: E731  every answer gets feedback
        wf = MultiTurnWorkflow(never_right, gcfg(1, max_new_tokens=5), tokenizer, rc, max_turns=3, feedback="again")
        batch = ctl.rollout_batch([{"prompt": "Say hi", "prompt_id": 0}, {"prompt": "Count", "prompt_id": 1}], wf)
        validate_trajectory(batch)
        assert batch["n_steps"].tolist() == [3, 3] and len(rec.calls) == 6
        piece = wf.user_turn_piece("again")
        for row in range(2):
            ids = batch["input_ids"][row][batch["attention_mask"][row]].tolist()
            calls = [(inp, c) for inp, c in rec.calls if ids[: len(inp)] == inp]
            assert len(calls) == 3
            calls.sort(key=lambda x: len(x[0]))
            # rebuild the row from the pieces the server saw and returned
            expected, mask = list(calls[0][0]), [False] * len(calls[0][0])
            for t, (inp, c) in enumerate(calls):
                assert inp == expected  # each request is exactly the conversation so far
                expected += c.output_ids
                mask += [True] * len(c.output_ids)
                if t < 2:
                    p = piece[1:] if c.output_ids and c.output_ids[-1] == piece[0] else piece
                    expected += p
                    mask += [False] * len(p)
            assert ids == expected
            assert batch["loss_mask"][row][: len(mask)].tolist() == mask
            assert (batch["versions"][row][batch["loss_mask"][row]] == 0).all()
        assert math.isclose(batch["rewards"].abs().sum().item(), 0.0)
    finally:
        ctl.stop()


# ------------------------------------------- hot-path shortcuts keep their meaning


def test_single_sample_group_matches_the_general_builder():
    from arealite.workflow.base import group_from_outputs, pad_and_stack, trajectory_row

    prompt = [11, 12, 13]
    out = ([5, 6, 7], [-0.5, -0.25, -1.0], [3, 3, 4])
    per_row = {"rewards": torch.tensor([1.0]), "group_id": torch.zeros(1, dtype=torch.int64)}
    one = group_from_outputs(prompt, [out], dict(per_row))
    ref = pad_and_stack([trajectory_row(prompt, [out])], dict(per_row))
    validate_trajectory(one)
    assert set(one.keys()) == set(ref.keys())
    for k in ref.keys():
        assert one[k].dtype == ref[k].dtype and torch.equal(one[k], ref[k]), k
    assert one["loss_mask"].tolist() == [[False] * 3 + [True] * 3]
    with pytest.raises(ValueError, match="3 tokens but 2 logprobs"):
        group_from_outputs(prompt, [([5, 6, 7], [-0.5, -0.25], [3, 3, 4])], dict(per_row))
    with pytest.raises(ValueError, match="no tokens"):
        group_from_outputs([], [([], [], [])], dict(per_row))


@pytest.mark.parametrize("n", [1, 3])
def test_validation_shortcut_for_built_groups_still_sees_later_edits(n):
    """A group from group_from_outputs skips per-token checks only while its tensors are untouched."""
    from arealite.api.types import TrajectoryError
    from arealite.workflow.base import group_from_outputs

    def fresh():
        outs = [([5, 6], [-0.5, -0.25], [3, 4])] * n
        return group_from_outputs([1, 2], outs, {"rewards": torch.zeros(n), "group_id": torch.zeros(n, dtype=torch.int64)})

    validate_trajectory(fresh())
    td = fresh()
    td["loss_mask"][0, 0] = True  # in place: the tensor's version counter moves
    td["attention_mask"][0, 0] = False
    with pytest.raises(TrajectoryError, match="'loss_mask' marks tokens outside"):
        validate_trajectory(td)
    td = fresh()
    td["logprobs"] = td["logprobs"].double()  # replaced: no longer the built tensor
    with pytest.raises(TrajectoryError, match="'logprobs' has dtype torch.float64"):
        validate_trajectory(td)
    td = fresh()
    td["rewards"] = torch.full((n,), float("nan"))  # per-row keys are always checked
    with pytest.raises(TrajectoryError, match="NaN"):
        validate_trajectory(td)


def test_mark_well_formed_is_the_builders_public_hook():
    """Any builder may vouch for its per-token tensors; the vouch covers exactly those tensors."""
    from arealite.api.types import PER_TOKEN_KEYS, TrajectoryError, mark_well_formed

    def td():
        t = _good_td()
        t["logprobs"] = t["logprobs"].double()  # wrong per-token dtype: caught only if checked
        return t

    with pytest.raises(TrajectoryError, match="'logprobs' has dtype"):
        validate_trajectory(td())
    vouched = td()
    assert mark_well_formed(vouched, tuple(vouched[k] for k in PER_TOKEN_KEYS)) is vouched
    validate_trajectory(vouched)  # per-token checks skipped: the builder vouched for them
    vouched["rewards"] = torch.tensor([float("nan"), 0.0])
    with pytest.raises(TrajectoryError, match="NaN"):  # per-row keys are always checked
        validate_trajectory(vouched)
    stale = td()
    mark_well_formed(stale, tuple(stale[k] for k in PER_TOKEN_KEYS))
    stale["versions"] = stale["versions"].clone()  # no longer the vouched tensor
    with pytest.raises(TrajectoryError, match="'logprobs' has dtype"):
        validate_trajectory(stale)


def test_fast_decode_agrees_with_the_tokenizer(tok):
    import random

    from arealite.utils.tokenizer import decode, decode_many

    rng = random.Random(0)
    vocab = len(tok)
    specials = list(tok.all_special_ids)
    seqs = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 40))] + rng.sample(specials, 1) for _ in range(200)]
    seqs.append(tok.encode("héllo wörld ✓ 12", add_special_tokens=False))
    seqs.append(seqs[-1][:-1])  # may cut a multi-byte character: both sides replace it the same way
    for skip in (True, False):
        for s in seqs:
            assert decode(tok, s, skip) == tok.decode(s, skip_special_tokens=skip), s
        assert decode_many(tok, seqs, skip) == [tok.decode(s, skip_special_tokens=skip) for s in seqs]
    for odd in ([vocab + 1000], [3, vocab + 5, 4]):  # ids the table does not know: the tokenizer decides
        assert decode(tok, odd) == tok.decode(odd, skip_special_tokens=True)


class RoutingEngine(ScriptedEngine):
    """A scripted engine that also reports MoE routing: token j of request k is routed to
    experts ``(k, j)`` (one layer, top-2), so a row's routing tells which turn ran it."""

    async def agenerate(self, req):
        comp = await super().agenerate(req)
        n = len(comp.input_ids) + len(comp.output_ids) - 1
        k = len(self.requests) - 1
        comp.routed_experts = torch.stack([torch.full((n,), k), torch.arange(n)], 1).to(torch.int32)
        return comp


@pytest.mark.parametrize("per_step", [False, True])
async def test_multi_turn_rows_carry_the_routing_of_the_turn_that_first_ran_each_token(tok, per_step):
    from arealite.moe.trajectory import ROUTED_EXPERTS_KEY

    async def env(item, text, ids, turn):
        return StepResult(0.5, done=turn == 2, feedback="more")

    eng = RoutingEngine(tok, ["a", "bb", "ccc"])
    wf = MultiTurnWorkflow(None, gcfg(1), tok, env=env, per_step=per_step, max_turns=3)
    td = await wf.arun_episode(eng, {"prompt": "go"})
    routing = td[ROUTED_EXPERTS_KEY]
    assert routing.dtype == torch.int16 and routing.shape[:2] == td["input_ids"].shape
    # request k ran tokens [0, len(input_k) + len(output_k) - 1): token j belongs to the first k
    ran = [len(r.input_ids) + len(tok.encode(a, add_special_tokens=False)) - 1
           for r, a in zip(eng.requests, ["a", "bb", "ccc"])]
    for row in range(td.batch_size[0]):
        n = int(td["attention_mask"][row].sum())
        assert (routing[row, 0] == -1).all() and (routing[row, n:] == -1).all()
        for j in range(n - 1):  # position j + 1 holds token j's routing
            first = next(k for k, r in enumerate(ran) if j < r)
            assert routing[row, j + 1].tolist() == [first, j]


# ------------------------------------------- groups kept in buffers until the batch


def _outs(seed: int, n: int, *, gen_max: int = 6):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(0, gen_max + 1, (1,), generator=g))
        out.append((torch.randint(1, 90, (k,), generator=g).tolist(), torch.rand(k, generator=g).tolist(),
                    torch.randint(0, 9, (k,), generator=g).tolist()))
    return out


def _buffers(prompt, outs, gid):
    from array import array

    from arealite.workflow.fast_group import GroupBuffers

    n = len(outs)
    return GroupBuffers(prompt, outs, {"rewards": array("f", [0.5 * i for i in range(n)]),
                                       "group_id": array("q", [gid] * n),
                                       "truncated": bytearray([i % 2 for i in range(n)])})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_batch_built_from_buffers_equals_the_concatenated_groups(seed):
    """Groups of different sizes, prompts and answer lengths (one prompt empty): the batch built
    at once from their buffers is the concatenation of their own TensorDicts, key by key, and a
    batch mixing buffers and TensorDicts is the same."""
    from arealite.workflow.base import concat_trajectories

    groups = [_buffers([3, 4, 5], _outs(seed, 3), 1), _buffers([], _outs(seed + 10, 1, gen_max=9), 2),
              _buffers([7] * 11, _outs(seed + 20, 2), 3)]
    tds = [g.to_tensordict() for g in groups]
    for td in tds:
        validate_trajectory(td)
    ref = concat_trajectories(tds)
    for batch in (concat_trajectories(groups), concat_trajectories([groups[0], tds[1], groups[2]])):
        assert batch.batch_size == ref.batch_size and set(batch.keys()) == set(ref.keys())
        for k in ref.keys():
            assert batch[k].dtype == ref[k].dtype and torch.equal(batch[k], ref[k]), k
    assert ref["truncated"].dtype == torch.bool and ref["rewards"].dtype == torch.float32


def test_full_width_groups_take_whole_buffers_and_match():
    """Rows all as wide as the batch (a fixed-length run) skip the per-row padding pass."""
    from arealite.workflow.base import concat_trajectories

    same = [([5, 6], [-0.5, -0.25], [3, 4])]
    groups = [_buffers([1, 2], same * 2, 1), _buffers([8, 9], same, 2)]
    batch = concat_trajectories(groups)
    assert batch["attention_mask"].all() and batch["input_ids"].tolist() == [[1, 2, 5, 6]] * 2 + [[8, 9, 5, 6]]
    assert batch["loss_mask"].tolist() == [[False, False, True, True]] * 3
    assert batch["group_id"].tolist() == [1, 1, 2]


def test_group_buffers_refuse_what_a_batch_cannot_hold():
    from array import array

    from arealite.workflow.base import concat_trajectories
    from arealite.workflow.fast_group import GroupBuffers

    one = [([5], [-0.5], [3])]
    with pytest.raises(ValueError, match="per-row key 'rewards': expected 1 values"):
        GroupBuffers([1], one, {"rewards": array("f", [1.0, 2.0])})
    with pytest.raises(ValueError, match="per-row key 'rewards'.*list"):
        GroupBuffers([1], one, {"rewards": [1.0]})
    with pytest.raises(ValueError, match="1 tokens but 0 logprobs"):
        GroupBuffers([1], [([5], [], [3])], {})
    with pytest.raises(ValueError, match="all trajectories of one batch need the same keys"):
        concat_trajectories([GroupBuffers([1], one, {"rewards": array("f", [1.0])}), GroupBuffers([1], one, {})])
    with pytest.raises(ValueError, match="'rewards' holds a non-finite value"):
        GroupBuffers([1], one, {"rewards": array("f", [float("nan")])})
    from arealite.api.types import TrajectoryError

    with pytest.raises(TrajectoryError, match=r"workflow W: missing key\(s\) \['group_id'\]"):
        GroupBuffers([1], one, {"rewards": array("f", [1.0])}).validate("workflow W")


async def test_rlvr_hands_the_controller_its_group_in_buffers_and_a_subclass_its_tensordict(tok):
    """`arun_group` returns the buffers, `arun_episode` the same group as a TensorDict; a subclass
    that reshapes `arun_episode`'s TensorDict gets its own shape through `arun_group` too."""
    from arealite.workflow.fast_group import GroupBuffers

    item = {"prompt": "What is 1 + 1?", "answer": "2", "prompt_id": 7}
    wf = RLVRWorkflow(math_reward, gcfg(2), tok)
    group = await wf.arun_group(ScriptedEngine(tok, ["#### 2", "so it is 3"]), item)
    td = await wf.arun_episode(ScriptedEngine(tok, ["#### 2", "so it is 3"]), item)
    assert isinstance(group, GroupBuffers)
    built = group.to_tensordict()
    for k in td.keys():
        if k != "group_id":  # a fresh id per episode
            assert torch.equal(built[k], td[k]), k

    class Tagged(RLVRWorkflow):
        async def arun_episode(self, client, item):
            td = await super().arun_episode(client, item)
            td["turn"] = torch.zeros(td.batch_size[0], dtype=torch.int64)
            return td

    tagged = await Tagged(math_reward, gcfg(2), tok).arun_group(ScriptedEngine(tok, ["#### 2"]), item)
    assert "turn" in tagged.keys()


def test_the_ready_set_keeps_buffers_through_a_filter_and_a_checkpoint():
    """Waiting groups in buffers: a filter reads their TensorDicts, a checkpoint stores them, and
    the batch taken after a restore is the batch taken without one."""
    from arealite.rollout.ready import ReadyGroups

    def filled() -> ReadyGroups:
        ready = ReadyGroups()
        for i in range(4):
            ready.put(_buffers([1, 2, 3][: i + 1], _outs(i, 2), i), {"prompt_id": i}, admitted_at=0)
        return ready

    ref, _ = filled().take(4, version=1)
    restored = ReadyGroups()
    restored.load_state_dict(filled().state_dict())
    batch, items = restored.take(4, version=1)
    assert [it["prompt_id"] for it in items] == [0, 1, 2, 3]
    for k in ref.keys():
        assert torch.equal(batch[k], ref[k]), k
    ready = filled()
    dropped = ready.filter(lambda td: int(td["group_id"][0]) % 2 == 0)
    assert [it["prompt_id"] for it in dropped] == [1, 3] and len(ready) == 2
