"""Logit bias and penalties (vLLM's semantics) against a per-token reference, and through the engine."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.logits_processors import apply_bias_and_penalties
from engine.sampler import sample
from engine.sequence import Sequence

V = 40


def seq(prompt: list[int], output: list[int], **params: float | dict[int, float]) -> Sequence:
    s = Sequence(request_id=str(random.random()), prompt_token_ids=prompt, params=SamplingParams(**params),
                 max_tokens=100)
    s.output_token_ids = list(output)
    return s


def reference(logits: list[float], s: Sequence) -> list[float]:
    """One row, one token at a time, as vLLM documents the order: bias, repetition, frequency, presence."""
    p = s.params
    out = list(logits)
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    for t in range(len(out)):
        if t in s.prompt_token_ids or t in s.output_token_ids:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        n = s.output_token_ids.count(t)
        out[t] -= p.frequency_penalty * n + (p.presence_penalty if n else 0.0)
    return out


def test_bias_and_penalties_equal_the_per_token_reference() -> None:
    rng = random.Random(0)
    seqs = []
    for _ in range(12):
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 15))]
        output = [rng.randrange(V) for _ in range(rng.randint(0, 20))]
        params: dict = {}
        if rng.random() < 0.7:
            params["repetition_penalty"] = rng.choice([1.0, 0.7, 1.3, 2.0])
            params["frequency_penalty"] = rng.uniform(-2, 2)
            params["presence_penalty"] = rng.uniform(-2, 2)
        if rng.random() < 0.5:
            params["logit_bias"] = {rng.randrange(V): rng.uniform(-100, 100) for _ in range(3)}
        seqs.append(seq(prompt, output, **params))
    logits = torch.randn(len(seqs), V, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    got = apply_bias_and_penalties(logits, seqs)
    for i, s in enumerate(seqs):
        assert got[i].tolist() == pytest.approx(reference(logits[i].tolist(), s), abs=1e-9)
    # nothing is copied when no row asks
    first = logits[:1]
    assert apply_bias_and_penalties(first, [seq([1, 2], [3])]) is first


def test_bias_steers_greedy_and_min_p_1_keeps_only_the_most_likely() -> None:
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(2))
    forced = seq([1], [], temperature=0.0, logit_bias={7: 100.0})
    banned_top = seq([1], [], temperature=0.0, logit_bias={int(logits[1].argmax()): -100.0})
    out = sample(logits, [forced, banned_top], torch.Generator())
    assert out[0].token == 7
    assert out[1].token != int(logits[1].argmax())
    assert out[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[7]))  # raw logits' logprob
    draws = {sample(logits[:1], [seq([1], [], temperature=2.0, min_p=1.0)], torch.Generator().manual_seed(k))[0].token
             for k in range(20)}
    assert draws == {int(logits[0].argmax())}


def test_sampling_params_refuse_values_vllm_refuses() -> None:
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
                {"min_p": 1.5}, {"logit_bias": {-1: 1.0}}, {"logit_bias": {3: 101.0}}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(str(tiny_model), dtype="float32", max_model_len=256) as llm:
        yield llm


def test_penalties_change_greedy_output_as_the_reference_step_by_step(llm) -> None:
    """The engine's greedy decode with penalties = argmax of the reference-penalized logits of the
    unpenalized model, token by token (prompt logits of prompt + output so far)."""
    prompt = [(i * 37) % 900 + 5 for i in range(12)]
    params = dict(repetition_penalty=2.0, frequency_penalty=2.0, presence_penalty=2.0, logit_bias={11: 20.0})
    got = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, **params))[0]
    plain = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert got.token_ids != plain.token_ids  # the penalties bite on this prompt
    out: list[int] = []
    for _ in range(10):
        # the next-token logits after prompt + out, from one prefill with prompt logits
        eng = llm.engine
        s = eng.add_request(prompt + out, SamplingParams(max_tokens=1, temperature=0.0), want_prompt_logits=True)
        while eng.has_unfinished():
            eng.step()
        penalized = reference(s.prompt_logits[-1].double().tolist(), seq(prompt, out, **params))  # last position's
        out.append(max(range(len(penalized)), key=penalized.__getitem__))
    assert got.token_ids == out
