"""FSDPEngine across processes: 2 ranks under real torchrun (gloo) equal 1 process.

The scenario lives in tests/_fsdp_worker.py: a few steps on one global batch
(rank 0 gets long sequences, rank 1 short ones, so rank 1 runs dummy
micro-batches), a sharded checkpoint, reload and retake of a step, log-probs,
a Hugging Face export, and PPO steps with sequence-mean loss aggregation. All on
the CPU (gloo), also on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch
from fsdp_scenario import load_worker, max_diff, two_ranks


@pytest.fixture(scope="module")
def two_rank_results(micro_model_dir, tmp_path_factory):
    return two_ranks(micro_model_dir, tmp_path_factory.mktemp("fsdp_2rank"))


@pytest.mark.slow
def test_two_ranks_match_one_process(two_rank_results, one_rank_results):
    _, (r0, r1) = two_rank_results
    single = one_rank_results
    assert r0["world"] == 2 and single["world"] == 1
    for s2, s1 in zip(r0["stats"], single["stats"]):
        assert s2["n_tokens"] == s1["n_tokens"] and s2["n_seqs"] == s1["n_seqs"] == 8
        assert abs(s2["loss"] - s1["loss"]) <= 1e-5
        assert abs(s2["grad_norm"] - s1["grad_norm"]) <= 1e-5
        assert s2["lr"] == pytest.approx(s1["lr"])
        assert s2["mean_logp"] == pytest.approx(-s2["loss"], abs=1e-6)
    # The loss went down: the steps did something.
    assert r0["stats"][-1]["loss"] < r0["stats"][0]["loss"]
    # Both ranks hold the same full weights, and they equal the 1-process weights.
    assert max_diff(r0["after_4"], r1["after_4"]) == 0.0
    assert max_diff(r0["after_4"], single["after_4"]) <= 1e-5
    # Log-probs of each rank's rows equal the 1-process log-probs of the same rows.
    logp_2 = torch.cat([r0["logp"], r1["logp"]])
    assert (logp_2 - single["logp"]).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_two_ranks_match_one_process_with_sequence_mean_ppo_loss(two_rank_results, one_rank_results):
    """Rank 0 holds 5 long sequences in 5 micro-batches, rank 1 3 short ones (and dummies):
    the step must still minimise the mean over all 8 sequences, as one process does."""
    _, (r0, r1) = two_rank_results
    single = one_rank_results
    assert set(single["seq_mean"]) == {"seq-mean-token-mean", "seq-mean-token-sum"}
    for mode, s1 in single["seq_mean"].items():
        s2 = r0["seq_mean"][mode]
        assert s2["n_seqs"] == s1["n_seqs"] == 8, mode
        assert s2["n_tokens_computed"] > s2["n_tokens"] == s1["n_tokens_computed"], mode  # rank 1 ran dummies
        assert abs(s2["loss"] - s1["loss"]) <= 1e-5, mode
        assert abs(s2["grad_norm"] - s1["grad_norm"]) <= 1e-5, mode
    assert max_diff(r0["after_seq_mean"], r1["after_seq_mean"]) == 0.0
    assert max_diff(r0["after_seq_mean"], single["after_seq_mean"]) <= 1e-5
    assert max_diff(single["after_seq_mean"], single["redone_4"]) > 1e-6  # the PPO steps moved the weights


@pytest.mark.slow
def test_two_ranks_match_one_process_with_gspo_mismatch_correction_and_global_whitening(two_rank_results,
                                                                                        one_rank_results):
    """GSPO's sequence ratio, sequence-level TIS and MIS, and advantage whitening over the global
    batch: 2 ranks with unequal halves take the same steps as 1 process."""
    _, (r0, r1) = two_rank_results
    single = one_rank_results
    assert torch.allclose(torch.cat([r0["whitened"], r1["whitened"]]), single["whitened"], atol=1e-6)
    assert set(single["new_losses"]) == {"gspo", "gspo_token_tis_seq", "ppo_mis_token"}
    for name, s1 in single["new_losses"].items():
        s2 = r0["new_losses"][name]
        assert abs(s2["loss"] - s1["loss"]) <= 1e-5, name
        assert abs(s2["grad_norm"] - s1["grad_norm"]) <= 1e-5, name
        assert s2["grad_norm"] > 0, name
        assert s2["mismatch_ratio_max"] == pytest.approx(s1["mismatch_ratio_max"], abs=1e-6), name
    # Token-mean stats are exact global token means when the loss weight counts tokens (ppo, token-mean);
    # under a seq-mean loss the engine weighs micro-batches by sequences, which depends on the split.
    s1, s2 = single["new_losses"]["ppo_mis_token"], r0["new_losses"]["ppo_mis_token"]
    assert s2["mismatch_kl_k3"] == pytest.approx(s1["mismatch_kl_k3"], abs=1e-6)
    assert s2["mismatch_masked_frac"] == pytest.approx(s1["mismatch_masked_frac"], abs=1e-6)
    assert single["new_losses"]["gspo_token_tis_seq"]["mismatch_truncated_frac"] > 0
    assert single["new_losses"]["ppo_mis_token"]["mismatch_masked_frac"] > 0
    assert max_diff(r0["after_new_losses"], single["after_new_losses"]) <= 1e-5


@pytest.mark.slow
def test_sharded_checkpoint_resume_equals_uninterrupted(two_rank_results, one_rank_results):
    _, (r0, r1) = two_rank_results
    for res in (r0, r1, one_rank_results):
        # Reloading really went back (weights differ from step 4) ...
        assert max_diff(res["restored_3"], res["after_4"]) > 1e-6
        # ... and retaking step 4 reproduces it exactly: weights, optimizer moments, LR.
        assert max_diff(res["redone_4"], res["after_4"]) == 0.0
        assert res["redo"]["loss"] == res["stats"][3]["loss"]
        assert res["lr_redone"] == res["lr_after_4"]


@pytest.mark.slow
def test_two_rank_export_loads_in_transformers(two_rank_results):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, (r0, _) = two_rank_results
    model = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)
    sd = model.state_dict()
    for name, t in r0["redone_4"].items():
        assert torch.equal(sd[name], t), name
    tok = AutoTokenizer.from_pretrained(out / "hf")
    assert tok.eos_token == "<|endoftext|>"


@pytest.mark.slow
def test_lora_two_ranks_match_one_process(micro_model_dir, tmp_path):
    """The same scenario with LoRA adapters: 2 ranks with unequal halves train the adapters as
    1 process does (losses, gradient norms, adapter and merged weights, log-probs, the PPO
    steps), only the adapters train, and resuming the sharded checkpoint retakes a step exactly."""
    out, (r0, r1) = two_ranks(micro_model_dir, tmp_path / "two", "lora")
    load_worker().run(str(micro_model_dir), str(tmp_path / "one"), lora=True)
    single = torch.load(tmp_path / "one" / "result_rank0.pt", weights_only=False)
    assert r0["world"] == 2 and single["world"] == 1
    n_adapter = sum(t.numel() for t in single["adapter"].values())
    assert single["adapter"] and r0["n_trainable"] == single["n_trainable"] == n_adapter
    for s2, s1 in zip(r0["stats"] + [r0["redo"]], single["stats"] + [single["redo"]]):
        assert abs(s2["loss"] - s1["loss"]) <= 1e-5 and abs(s2["grad_norm"] - s1["grad_norm"]) <= 1e-5
    assert r0["stats"][-1]["loss"] < r0["stats"][0]["loss"]
    assert max_diff(r0["adapter"], r1["adapter"]) == 0.0
    # Weights within 1e-4 (a step moves them by ~lr = 1e-2): A's first gradients are ~0 (B starts
    # at 0) and Adam divides them by their own tiny size, which magnifies the reduction order's
    # rounding; a wrong scaling over ranks would differ by a whole step.
    assert max_diff(r0["adapter"], single["adapter"]) <= 1e-4
    assert max(t.abs().max().item() for n, t in single["adapter"].items() if "lora_B" in n) > 1e-3  # B moved
    for key in ("after_4", "after_seq_mean", "after_new_losses"):
        assert max_diff(r0[key], single[key]) <= 1e-4, key
    assert (torch.cat([r0["logp"], r1["logp"]]) - single["logp"]).abs().max().item() <= 1e-4
    for mode, s1 in single["seq_mean"].items():
        assert abs(r0["seq_mean"][mode]["loss"] - s1["loss"]) <= 1e-5, mode
        assert abs(r0["seq_mean"][mode]["grad_norm"] - s1["grad_norm"]) <= 1e-5, mode
    for res in (r0, single):  # resume from the sharded checkpoint retakes step 4 exactly
        assert max_diff(res["restored_3"], res["after_4"]) > 1e-6
        assert max_diff(res["redone_4"], res["after_4"]) == 0.0
    assert (out / "hf" / "adapter_config.json").is_file()  # the export is the PEFT adapter
