"""PPOActor and SFT on a micro tiny model, through a plain (unsharded) engine stand-in.

``PlainEngine`` implements the train-engine contract of docs/internals.md
(packed micro-batches, shifted per-token keys, weighted micro-batch means) on a
plain HF model, written independently of arealite/train_engine so that it checks the
contract rather than an implementation. tests/test_algo_fsdp.py runs PPOActor
on the real FSDPEngine.
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict
from transformers import AutoModelForCausalLM, AutoTokenizer

from arealite.algo import (
    PPOActor,
    build_sft_batch,
    group_advantages,
    normalize_advantages,
    sft_loss_fn,
    sft_loss_weight,
    split_minibatches,
    stepwise_advantages,
)
from arealite.config.schema import AlgorithmConfig
from arealite.train_engine.lm_head import ChunkedHead


class PlainEngine:
    """Stand-in train engine: the FSDPEngine contract on an unsharded HF model."""

    def __init__(self, model_dir, lr: float = 1e-3, mb_max_tokens: int = 10**9, optimizer: str = "adamw"):
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()  # the micro model has no dropout; train() only to mirror the real engine
        params = self.model.parameters()
        self.opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0) if optimizer == "adamw" \
            else torch.optim.SGD(params, lr=lr)
        self.mb_max_tokens = mb_max_tokens
        self.n_steps = 0
        self.n_mbs_seen: list[int] = []

    def _micro_batches(self, batch):
        data = {k: batch[k] for k in batch.keys()}
        B, L = data["input_ids"].shape
        lengths = [int(n) for n in data["attention_mask"].sum(1)]
        groups, cur, cur_tokens = [], [], 0
        for r in range(B):  # in order, greedily, under the token budget
            if cur and cur_tokens + lengths[r] > self.mb_max_tokens:
                groups.append(cur)
                cur, cur_tokens = [], 0
            cur.append(r)
            cur_tokens += lengths[r]
        groups.append(cur)
        for rows in groups:
            mb = {}
            for k, v in data.items():
                if v.dim() >= 2 and tuple(v.shape[:2]) == (B, L):
                    parts = []
                    for r in rows:
                        seq = v[r, : lengths[r]]
                        if k != "input_ids":  # shift: position t holds the value of token t+1
                            seq = torch.cat([seq[1:], torch.zeros_like(seq[:1])])
                        parts.append(seq)
                    mb[k] = torch.cat(parts)
                else:
                    mb[k] = v[rows]
            ids = [data["input_ids"][r, : lengths[r]] for r in rows]
            mb["labels"] = torch.cat([torch.cat([s[1:], torch.zeros_like(s[:1])]) for s in ids])
            mb["position_ids"] = torch.cat([torch.arange(len(s)) for s in ids])
            cu = [0]
            for s in ids:
                cu.append(cu[-1] + len(s))
            mb["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
            yield mb, rows, lengths

    def _logits(self, mb):
        cu = mb["cu_seqlens"].tolist()
        outs = [self.model(input_ids=mb["input_ids"][None, cu[i] : cu[i + 1]]).logits[0]
                for i in range(len(cu) - 1)]
        return torch.cat(outs).float()

    @torch.no_grad()
    def forward(self, batch, post_hook):
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        for mb, rows, lengths in self._micro_batches(batch):
            vals = post_hook(ChunkedHead.from_logits(self._logits(mb)), mb)
            s = 0
            for r in rows:
                n = lengths[r]
                out[r, 1:n] = vals[s : s + n - 1]
                s += n
        return out

    def train_batch(self, batch, loss_fn, loss_weight_fn):
        mbs = list(self._micro_batches(batch))
        weights = [float(loss_weight_fn(mb)) for mb, _, _ in mbs]
        total = sum(weights)
        self.opt.zero_grad(set_to_none=True)
        loss_sum, stats = 0.0, {}
        for (mb, _, _), w in zip(mbs, weights):
            loss = loss_fn(ChunkedHead.from_logits(self._logits(mb)), mb)
            (loss * (w / total)).backward()
            loss_sum += float(loss.detach()) * w / total
            for k, v in mb.get("_stats", {}).items():
                stats[k] = stats.get(k, 0.0) + float(v) * w / total
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1e9))
        self.opt.step()
        self.n_steps += 1
        self.n_mbs_seen.append(len(mbs))
        return {"loss": loss_sum, "grad_norm": grad_norm, **stats}


def make_batch(vocab: int, seed: int = 0, n_groups: int = 2, group_size: int = 4) -> TensorDict:
    """Right-padded trajectories: groups share a prompt; completions vary in length."""
    g = torch.Generator().manual_seed(seed)
    B = n_groups * group_size
    rows = []
    for grp in range(n_groups):
        prompt = torch.randint(5, vocab, (int(torch.randint(3, 6, (1,), generator=g)),), generator=g).tolist()
        for _ in range(group_size):
            comp = torch.randint(5, vocab, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
            rows.append((prompt, comp, grp * 10 + 3))
    L = max(len(p) + len(c) for p, c, _ in rows)
    ids = torch.zeros(B, L, dtype=torch.long)
    am = torch.zeros(B, L, dtype=torch.bool)
    lm = torch.zeros(B, L, dtype=torch.bool)
    for b, (p, c, _) in enumerate(rows):
        ids[b, : len(p) + len(c)] = torch.tensor(p + c)
        am[b, : len(p) + len(c)] = True
        lm[b, len(p) : len(p) + len(c)] = True
    return TensorDict({
        "input_ids": ids, "attention_mask": am, "loss_mask": lm,
        "logprobs": torch.zeros(B, L), "versions": torch.where(lm, 0, -1),
        "rewards": torch.zeros(B), "group_id": torch.tensor([gid for _, _, gid in rows]),
    }, batch_size=[B])


def seq_logp(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (logp * mask).sum(1)


@pytest.fixture()
def vocab(micro_model_dir) -> int:
    return AutoTokenizer.from_pretrained(micro_model_dir).vocab_size


def test_compute_logp_matches_plain_hf_forward(micro_model_dir, vocab):
    engine = PlainEngine(micro_model_dir, mb_max_tokens=20)  # several micro-batches
    actor = PPOActor(AlgorithmConfig(), engine, temperature=0.7)
    batch = make_batch(vocab)
    got = actor.compute_logp(batch)
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(micro_model_dir, dtype=torch.float32)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long()).logits
    am = batch["attention_mask"]
    for b in range(batch.batch_size[0]):
        n = int(am[b].sum())
        assert got[b, 0] == 0 and (got[b, n:] == 0).all()
        for j in range(1, n):
            want = torch.log_softmax(logits[b, j - 1].double() / 0.7, -1)[batch["input_ids"][b, j]]
            assert abs(float(got[b, j]) - float(want)) <= 1e-5, (b, j)


@pytest.mark.parametrize("decoupled", [True, False])
def test_ppo_update_moves_logp_with_the_advantage(micro_model_dir, vocab, decoupled):
    engine = PlainEngine(micro_model_dir, lr=2e-3, mb_max_tokens=24)
    cfg = AlgorithmConfig(use_decoupled_loss=decoupled, adv_estimator="grpo")
    actor = PPOActor(cfg, engine, temperature=1.0)
    batch = make_batch(vocab, seed=1)
    mask = batch["loss_mask"]
    behav = actor.compute_logp(batch)
    # A slightly stale behaviour policy: the loss must still run (weights near 1, none capped).
    batch["logprobs"] = torch.where(mask, behav + 0.01 * torch.randn(behav.shape), torch.zeros(()))
    if decoupled:
        batch["prox_logp"] = behav
    batch["rewards"] = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    actor.compute_advantages(batch)
    seq_adv = batch["advantages"].sum(1) / mask.sum(1)
    before = seq_logp(behav, mask)
    stats = actor.ppo_update(batch)
    assert len(stats) == 1 and engine.n_steps == 1
    assert engine.n_mbs_seen[0] > 1, "the update should span several micro-batches"
    after = seq_logp(actor.compute_logp(batch), mask)
    delta = after - before
    pos, neg = seq_adv > 0, seq_adv < 0
    assert pos.sum() == 3 and neg.sum() == 5
    assert (delta[pos] > 0).all(), delta
    assert (delta[neg] < 0).all(), delta
    s = stats[0]
    for key in ("loss", "grad_norm", "clip_frac_low", "entropy", "adv_mean", "adv_max", "approx_kl_prox"):
        assert math.isfinite(s[key]), key
    assert s["clip_frac_low"] == 0 and s["clip_frac_high"] == 0  # first step: ratio == 1
    if decoupled:
        assert 0.9 < s["imp_weight_mean"] < 1.1 and s["imp_weight_capped_frac"] == 0
        assert 0 < s["logp_mismatch_mean"] < s["logp_mismatch_max"] < 0.1
        assert s["logp_mismatch_max_batch"] >= s["logp_mismatch_max"] - 1e-6


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_gradient_does_not_depend_on_micro_batching(micro_model_dir, vocab, mode):
    # The loss/weight pair must make the engine's weighted mean over micro-batches
    # equal the loss of the whole batch, in every aggregation mode.
    batch = make_batch(vocab, seed=2)
    cfg = AlgorithmConfig(loss_agg_mode=mode, eps_clip=0.2, c_clip=3.0)
    grads = []
    for budget in (10**9, 15):
        engine = PlainEngine(micro_model_dir, lr=0.0, mb_max_tokens=budget, optimizer="sgd")
        actor = PPOActor(cfg, engine, temperature=1.0, max_new_tokens=16)
        b = batch.clone()
        b["logprobs"] = actor.compute_logp(b) - 0.3 * b["loss_mask"]  # off-policy: weights and clipping
        b["prox_logp"] = actor.compute_logp(b)
        b["rewards"] = torch.arange(8, dtype=torch.float32) % 3
        actor.compute_advantages(b)
        actor.ppo_update(b)
        grads.append(torch.cat([p.grad.flatten() for p in engine.model.parameters()]))
    assert engine.n_mbs_seen[0] >= 4
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-4)


def test_compute_advantages_paths(micro_model_dir, vocab):
    batch = make_batch(vocab, seed=3)
    mask = batch["loss_mask"]
    batch["rewards"] = torch.tensor([1.0, 3.0, 0.0, 2.0, 5.0, 5.0, 5.0, 5.0])
    cfg = AlgorithmConfig(adv_estimator="rloo", reward_scale=2.0, reward_bias=-1.0, reward_clip=4.0)
    actor = PPOActor(cfg, engine=None, temperature=1.0)
    actor.compute_advantages(batch)
    r = ((batch["rewards"] - 1.0) * 2.0).clamp(-4, 4)
    want = group_advantages(r, batch["group_id"], "rloo")
    torch.testing.assert_close(batch["advantages"], torch.where(mask, want[:, None], torch.zeros(())))
    assert actor.adv_stats["adv_zero_seq_frac"] == 0.5  # the second group has equal rewards
    assert actor.adv_stats["adv_max"] == float(want.max())

    # Batch whitening over loss tokens.
    actor = PPOActor(AlgorithmConfig(adv_estimator="drgrpo", adv_norm="batch"), None, 1.0)
    actor.compute_advantages(batch)
    tok = torch.where(mask, group_advantages(batch["rewards"], batch["group_id"], "drgrpo")[:, None], 0.0)
    torch.testing.assert_close(batch["advantages"], normalize_advantages(tok, mask))
    assert abs(float(batch["advantages"][mask].mean())) < 1e-5

    # Multi-step runs: traj_id / step_id switch to step-wise advantages.
    batch["traj_id"] = torch.tensor([0, 0, 1, 1, 2, 3, 3, 3])
    batch["step_id"] = torch.tensor([0, 1, 0, 1, 0, 0, 1, 2])
    batch["group_id"] = torch.tensor([7, 7, 7, 7, 8, 8, 8, 8])
    actor = PPOActor(AlgorithmConfig(adv_estimator="grpo", stepwise_divide_by_steps=True), None, 1.0)
    actor.compute_advantages(batch)
    want = stepwise_advantages(batch["rewards"], batch["group_id"], batch["traj_id"], batch["step_id"],
                               "grpo", True)
    torch.testing.assert_close(batch["advantages"], torch.where(mask, want[:, None], torch.zeros(())))
    assert want[0] != 0 and math.isclose(float(want[0]), float(want[1]))

    del batch["group_id"]
    with pytest.raises(KeyError, match="group_id"):
        actor.compute_advantages(batch)


def test_split_minibatches_keeps_groups_whole():
    gid = torch.tensor([5, 1, 5, 9, 1, 9, 2, 2, 5])
    td = TensorDict({"group_id": gid, "x": torch.arange(9)}, batch_size=[9])
    parts = split_minibatches(td, 2)
    assert sorted(torch.cat([p["x"] for p in parts]).tolist()) == list(range(9))
    for p in parts:
        for g_ in p["group_id"].unique():
            assert (p["group_id"] == g_).sum() == (gid == g_).sum()
    assert len(split_minibatches(td, 4)) == 4  # as many groups as mini-batches
    assert len(split_minibatches(td, 6)) == 6  # more than groups: rows
    with pytest.raises(ValueError, match="n_minibatches"):
        split_minibatches(td, 10)


def test_minibatches_and_kl_to_reference(micro_model_dir, vocab):
    engine = PlainEngine(micro_model_dir, lr=1e-3)
    ref = PlainEngine(micro_model_dir)
    cfg = AlgorithmConfig(n_minibatches=2, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01)
    actor = PPOActor(cfg, engine, temperature=1.0, ref_engine=ref)
    batch = make_batch(vocab, seed=4)
    batch["logprobs"] = actor.compute_logp(batch)
    batch["rewards"] = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    actor.compute_advantages(batch)
    stats = actor.ppo_update(batch)
    assert len(stats) == 2 and engine.n_steps == 2
    assert "ref_logp" in batch.keys()
    assert stats[0]["kl_ref"] < 1e-6  # same weights as the reference before the first step
    assert stats[1]["kl_ref"] > 0  # the second mini-batch sees the updated policy

    no_ref = PPOActor(cfg, engine, temperature=1.0)
    del batch["ref_logp"]
    with pytest.raises(ValueError, match="kl_coef"):
        no_ref.ppo_update(batch)
    del batch["advantages"]
    with pytest.raises(KeyError, match="compute_advantages"):
        actor.ppo_update(batch)


def test_actor_rejects_bad_settings():
    with pytest.raises(ValueError, match="loss_agg_constant"):
        PPOActor(AlgorithmConfig(loss_agg_mode="seq-mean-token-sum"), None, 1.0)
    PPOActor(AlgorithmConfig(loss_agg_mode="seq-mean-token-sum"), None, 1.0, max_new_tokens=64)
    with pytest.raises(ValueError, match="c_clip"):
        PPOActor(AlgorithmConfig(c_clip=0.5), None, 1.0)
    with pytest.raises(ValueError, match="temperature"):
        PPOActor(AlgorithmConfig(), None, 0.0)


# ---------------------------------------------------------------------- SFT


def test_build_sft_batch_layout(micro_model_dir):
    tok = AutoTokenizer.from_pretrained(micro_model_dir)
    prompts, comps = ["1 + 2 =", "the cat"], [" 3", " sat on the mat"]
    td = build_sft_batch(tok, prompts, comps)
    for b, (p, c) in enumerate(zip(prompts, comps)):
        p_ids = tok(p, add_special_tokens=False)["input_ids"]
        c_ids = tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        n = len(p_ids) + len(c_ids)
        assert td["input_ids"][b, :n].tolist() == p_ids + c_ids
        assert td["attention_mask"][b].tolist() == [True] * n + [False] * (td["input_ids"].shape[1] - n)
        assert td["loss_mask"][b].tolist() == [False] * len(p_ids) + [True] * len(c_ids) + [False] * (td["input_ids"].shape[1] - n)
        assert (td["input_ids"][b, n:] == tok.pad_token_id).all()
    with pytest.raises(ValueError, match="completions"):
        build_sft_batch(tok, prompts, comps[:1])
    with pytest.raises(ValueError, match="prompts\\[0\\] is empty"):
        build_sft_batch(tok, [""], ["x"])
    with pytest.raises(ValueError, match="max_len"):
        build_sft_batch(tok, prompts, comps, max_len=3)


def test_sft_loss_is_cross_entropy_and_training_reduces_it(micro_model_dir):
    tok = AutoTokenizer.from_pretrained(micro_model_dir)
    batch = build_sft_batch(tok, ["1 + 2 =", "2 + 2 =", "the"] * 2, [" 3", " 4", " cat sat"] * 2)
    engine = PlainEngine(micro_model_dir, lr=1e-2, mb_max_tokens=20)

    # sft_loss_fn equals torch's cross-entropy on the completion tokens of a micro-batch.
    mb, _, _ = next(engine._micro_batches(batch))
    logits = torch.randn(mb["labels"].shape[0], tok.vocab_size + 8)
    want = torch.nn.functional.cross_entropy(logits[mb["loss_mask"]], mb["labels"][mb["loss_mask"]])
    assert math.isclose(float(sft_loss_fn(ChunkedHead.from_logits(logits), mb)), float(want), rel_tol=1e-6)
    assert sft_loss_weight(mb) == float(mb["loss_mask"].sum())

    def nll() -> float:
        lp = engine.forward(batch, lambda lg, m: torch.log_softmax(lg.logits(), -1).gather(-1, m["labels"][:, None])[:, 0])
        return float(-(lp * batch["loss_mask"]).sum() / batch["loss_mask"].sum())

    start = nll()
    losses = [engine.train_batch(batch, sft_loss_fn, sft_loss_weight)["loss"] for _ in range(8)]
    assert math.isclose(losses[0], start, rel_tol=1e-4)  # the engine's loss is the batch NLL
    assert nll() < 0.7 * start


def test_one_minibatch_takes_the_proximal_policy_from_the_training_forward(micro_model_dir, vocab):
    """With n_minibatches=1 the decoupled loss needs no compute_logp pass: same update, same stats."""
    cfg = AlgorithmConfig(use_decoupled_loss=True, behav_imp_weight_cap=5.0, n_minibatches=1)
    assert PPOActor(cfg, None, temperature=1.0).needs_prox_logp is False
    assert PPOActor(cfg.model_copy(update={"n_minibatches": 2}), None, temperature=1.0).needs_prox_logp is True
    assert PPOActor(cfg.model_copy(update={"use_decoupled_loss": False, "n_minibatches": 2}), None,
                    temperature=1.0).needs_prox_logp is False

    batch = make_batch(vocab, seed=3)
    batch["rewards"] = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    results = []
    for explicit in (True, False):
        engine = PlainEngine(micro_model_dir, lr=1e-2, mb_max_tokens=24)
        actor = PPOActor(cfg, engine, temperature=1.0)
        b = batch.clone()
        # Stale behaviour log-probs: importance weights away from 1, some above the cap.
        b["logprobs"] = torch.where(b["loss_mask"], actor.compute_logp(b) - 0.8 * torch.rand(b["loss_mask"].shape,
                                    generator=torch.Generator().manual_seed(0)), torch.zeros(()))
        if explicit:
            b["prox_logp"] = actor.compute_logp(b)
        actor.compute_advantages(b)
        stats = actor.ppo_update(b)[0]
        results.append((stats, [p.detach().clone() for p in engine.model.parameters()]))
    (s_exp, p_exp), (s_fwd, p_fwd) = results
    for a, b in zip(p_exp, p_fwd):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for key in ("imp_weight_mean", "imp_weight_capped_frac", "approx_kl_behav", "logp_mismatch_mean", "loss"):
        assert s_fwd[key] == pytest.approx(s_exp[key], rel=1e-4, abs=1e-6), key
    assert s_fwd["imp_weight_mean"] > 1.05  # the behaviour weights were applied, not ignored
