"""Sampler behaviour through the engine: seeds, filters, stops, logprobs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(str(tiny_model), dtype="float32", max_model_len=256) as llm:
        yield llm


def _prompt(seed: int, n: int = 20) -> list[int]:
    return torch.randint(4, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_seeded_sampling_is_reproducible_and_independent_of_neighbours(llm) -> None:
    sp = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([_prompt(0)], sp)[0].token_ids
    crowded = llm.generate([_prompt(1), _prompt(0), _prompt(2)],
                           [SamplingParams(max_tokens=9, temperature=0.9), sp, SamplingParams(max_tokens=16)])
    assert crowded[1].token_ids == alone
    other_seed = llm.generate([_prompt(0)], SamplingParams(max_tokens=16, temperature=1.0, seed=99,
                                                          ignore_eos=True))[0]
    assert other_seed.token_ids != alone


def test_top_k_1_and_tiny_top_p_are_greedy(llm) -> None:
    greedy = llm.generate([_prompt(3)], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    k1 = llm.generate([_prompt(3)], SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=1,
                                                    ignore_eos=True))[0]
    p0 = llm.generate([_prompt(3)], SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, seed=2,
                                                    ignore_eos=True))[0]
    assert k1.token_ids == greedy.token_ids == p0.token_ids


def test_top_k_restricts_choices(llm) -> None:
    """With top_k=3 every sampled token is among the 3 most likely under the raw logits."""
    out = llm.generate([_prompt(4)], SamplingParams(max_tokens=20, temperature=5.0, top_k=3, seed=7,
                                                     logprobs=3, ignore_eos=True))[0]
    for tok, top in zip(out.token_ids, out.top_logprobs):
        assert tok in top


def test_logprobs_chosen_and_top_n(llm) -> None:
    out = llm.generate([_prompt(5)], SamplingParams(max_tokens=8, temperature=0.0, logprobs=5,
                                                     ignore_eos=True))[0]
    assert len(out.logprobs) == len(out.top_logprobs) == 8
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert len(top) == 5
        values = list(top.values())
        assert values == sorted(values, reverse=True)
        assert top[tok] == pytest.approx(lp) and lp == pytest.approx(max(values))  # greedy picks the top
        assert lp <= 0 and math.isfinite(lp)


def test_prompt_logprobs(llm) -> None:
    p = _prompt(6, 30)
    out = llm.generate([p], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))[0]
    logits = llm.prompt_logits([p])[0]
    ref = torch.log_softmax(logits, -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 30
    for i in range(1, 30):
        assert out.prompt_logprobs[i] == pytest.approx(ref[i - 1, p[i]].item(), abs=1e-5)
        assert len(out.prompt_top_logprobs[i]) == 2


def test_stop_token_ids_eos_and_ignore_eos(llm) -> None:
    free = llm.generate([_prompt(7)], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    stopped = llm.generate([_prompt(7)], SamplingParams(max_tokens=10, temperature=0.0,
                                                         stop_token_ids=[stop_at]))[0]
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"
    # the same token as EOS: stops unless ignore_eos
    original = llm.engine.model_config
    llm.engine.model_config = dataclasses.replace(original, eos_token_ids=(stop_at,))
    try:
        eos = llm.generate([_prompt(7)], SamplingParams(max_tokens=10, temperature=0.0))[0]
        ignored = llm.generate([_prompt(7)], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    finally:
        llm.engine.model_config = original
    assert eos.finish_reason == "stop" and eos.token_ids == free.token_ids[: first + 1]
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_min_tokens_suppresses_stop(llm) -> None:
    free = llm.generate([_prompt(7)], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    stop_at = free.token_ids[0]
    out = llm.generate([_prompt(7)], SamplingParams(max_tokens=10, temperature=0.0, min_tokens=3,
                                                     stop_token_ids=[stop_at]))[0]
    assert len(out.token_ids) >= 3 and stop_at not in out.token_ids[:3]


def test_text_prompts_and_stop_strings(llm) -> None:
    out = llm.generate("The cluster serves", SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode("The cluster serves")
    assert out.text == tok.decode(out.token_ids)
    assert len(out.text) > 4, out.text
    stop = out.text[2:4]
    cut = llm.generate("The cluster serves", SamplingParams(max_tokens=20, temperature=0.0, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == out.text[: out.text.find(stop)]


def test_max_tokens_is_capped_by_max_model_len(llm) -> None:
    out = llm.generate([_prompt(8, 250)], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    assert llm.engine.num_used_blocks == 0


def test_top_p_applies_to_what_top_k_kept() -> None:
    """top_k first, then top_p over the renormalised survivors (vLLM's and transformers' order)."""
    from engine.sampler import _filter_sorted

    logits = torch.tensor([[0.3, 0.2, 0.125, 0.125, 0.125, 0.125]]).log()
    kept = _filter_sorted(logits, torch.tensor([2]), torch.tensor([0.45])).isfinite()[0].tolist()
    assert kept == [True, False, False, False, False, False]  # 0.3 / 0.5 = 0.6 already reaches 0.45
    kept = _filter_sorted(logits, torch.tensor([6]), torch.tensor([0.45])).isfinite()[0].tolist()
    assert kept == [True, True, False, False, False, False]  # without top_k: 0.3 + 0.2 reaches 0.45
