"""The native engine against Hugging Face transformers on the same random tiny weights (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import set_decode_form
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams

CONFIGS = ["v2_dense", "v2_moe", "v3"]
LENGTHS = (7, 33, 129, 300)


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 1000, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module", params=CONFIGS)
def pair(request, tiny_models):
    path = tiny_models[request.param]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", max_model_len=1024)
    yield request.param, hf, llm
    llm.shutdown()


def test_prompt_logits_match_transformers(pair) -> None:
    name, hf, llm = pair
    prompts = _prompts(0)
    ours = llm.prompt_logits(prompts)  # one batch of mixed lengths
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() < 1e-4, name
    assert llm.engine.num_used_blocks == 0


def test_greedy_32_tokens_match_transformers(pair) -> None:
    name, hf, llm = pair
    prompts = _prompts(1)
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=1))
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert out.token_ids == ref[0, len(p):].tolist(), name
        assert len(out.logprobs) == 32
    assert llm.engine.num_used_blocks == 0


def test_absorbed_decode_equals_decompressed_decode(pair) -> None:
    name, _, llm = pair
    prompts = _prompts(2)
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    absorbed = llm.generate(prompts, sp)
    set_decode_form(llm.engine.model, "decompressed")
    try:
        decompressed = llm.generate(prompts, sp)
    finally:
        set_decode_form(llm.engine.model, "absorbed")
    for a, b in zip(absorbed, decompressed):
        assert a.token_ids == b.token_ids, name
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
