"""Unit tests of the embedded server's request parsing, sampler and CLI (no HTTP)."""

from __future__ import annotations

import pytest
import torch

from arealite.server.args import parse_args
from arealite.server.generate_request import RequestError, parse_generate, parse_sampling_params
from arealite.server.sampling import BatchSamplingState, SamplingConfig, filter_probs, sample_next


def _parse(body, vocab=100, ctx=64):
    # the default max_new_tokens (128) shrinks to fit the context
    return parse_generate(body, vocab_size=vocab, context_length=ctx, encode=None)


def test_parse_single_and_batch():
    (one,), batch = _parse({"input_ids": [1, 2, 3], "rid": "r", "sampling_params": {"max_new_tokens": 5}})
    assert not batch and one.rid == "r" and one.input_ids == [1, 2, 3] and one.sampling.max_new_tokens == 5
    many, batch = _parse({"input_ids": [[1], [2, 3]], "sampling_params": [{"temperature": 0}, {"top_k": 3}],
                          "return_logprob": [True, False]})
    assert batch and [m.input_ids for m in many] == [[1], [2, 3]]
    assert many[0].sampling.greedy and many[1].sampling.top_k == 3
    assert [m.return_logprob for m in many] == [True, False]
    assert many[0].rid != many[1].rid


def test_neutral_values_of_unimplemented_keys_are_accepted():
    sc = parse_sampling_params({"repetition_penalty": 1.0, "frequency_penalty": 0, "stop": [], "n": 1,
                                "min_new_tokens": 0, "json_schema": None, "temperature": None}, 100)
    assert sc == SamplingConfig()


@pytest.mark.parametrize("sp, needle", [
    ({"repetition_penalty": 1.3}, "repetition_penalty=1.3 is not supported"),
    ({"regex": "a+"}, "regex"),
    ({"n": 3}, "n=3"),
    ({"top_k": 0}, "top_k"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"stop_token_ids": [100]}, "stop_token_ids"),
    ({"temperature": float("nan")}, "temperature"),
])
def test_bad_sampling_params_name_the_field(sp, needle):
    with pytest.raises(RequestError, match=needle.replace("(", r"\(").replace("+", r"\+")):
        parse_sampling_params(sp, 100)


def test_context_length_names_max_new_tokens():
    with pytest.raises(RequestError, match="max_new_tokens.*context length 64"):
        _parse({"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 55}})
    _parse({"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 54}})  # exactly fits


def test_text_needs_a_tokenizer():
    with pytest.raises(RequestError, match="skip-tokenizer-init"):
        _parse({"text": "hello"})


def test_filter_probs_top_p_top_k_min_p():
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3)
    out = filter_probs(p, top_p=torch.tensor([0.75, 1.0, 1.0]), top_k=torch.tensor([4, 2, 4]),
                       min_p=torch.tensor([0.0, 0.0, 0.25]))
    # top_p 0.75: 0.5 and 0.3 (mass before 0.3 is 0.5 < 0.75; before 0.15 it is 0.8 > 0.75)
    assert out[0].tolist() == pytest.approx([0.5, 0.3, 0.0, 0.0])
    assert out[1].tolist() == pytest.approx([0.5, 0.3, 0.0, 0.0])  # top_k 2
    assert out[2].tolist() == pytest.approx([0.5, 0.3, 0.15, 0.0])  # min_p: floor 0.125


def test_sampler_matches_the_distribution_and_reports_full_vocab_logprob():
    torch.manual_seed(0)
    logits = torch.randn(1, 6)
    T = 0.7
    configs = [SamplingConfig(temperature=T)] * 4000
    state = BatchSamplingState.build(configs, [None] * len(configs), 6, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    tokens, lps = sample_next(logits.expand(len(configs), 6), state, gen)
    want = torch.softmax(logits[0] / T, -1)
    freq = torch.bincount(tokens, minlength=6).float() / len(configs)
    assert (freq - want).abs().max() < 0.03
    assert torch.allclose(lps, torch.log(want)[tokens], atol=1e-6)


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    logits = torch.randn(3, 50)
    cfg = SamplingConfig(temperature=1.0)
    seeds = [11, 12, 13]

    def draw(rows):
        gens = [torch.Generator().manual_seed(seeds[r]) for r in rows]
        state = BatchSamplingState.build([cfg] * len(rows), gens, 50, torch.device("cpu"))
        return sample_next(logits[rows], state, torch.Generator())[0].tolist()

    together = [draw([0, 1, 2]) for _ in range(2)]
    alone = [draw([r])[0] for r in range(3)]
    assert together[0] == together[1] == alone


def test_greedy_rows_take_the_argmax_with_t1_logprob():
    logits = torch.randn(2, 30)
    state = BatchSamplingState.build([SamplingConfig(temperature=0.0), SamplingConfig(temperature=1e-7)],
                                     [None, None], 30, torch.device("cpu"))
    tokens, lps = sample_next(logits, state, torch.Generator())
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(lps, torch.log_softmax(logits, -1).max(-1).values)


def test_cli_args():
    a = parse_args(["--model-path", "m", "--port", "1234", "--api-key", "s3cret", "--max-batch-size", "8"])
    assert a.port == 1234 and a.max_batch_size == 8 and a.host == "127.0.0.1"
    assert "s3cret" not in repr(a)
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--port", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--dtype", "int8"])
    assert parse_args(["--model-path", "m"]).prompt_cache_entries == 64
    assert parse_args(["--model-path", "m", "--prompt-cache-entries", "0"]).prompt_cache_entries == 0


def test_a_negative_prompt_cache_size_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--prompt-cache-entries", "-1"])
    assert "--prompt-cache-entries -1 must be at least 0" in capsys.readouterr().err
