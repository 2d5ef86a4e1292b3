"""Chunked prefill (one prompt over several steps, merged by log-sum-exp) equals a single pass."""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(4, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_600_token_prompt_in_chunks_of_64_equals_one_pass(tiny_model) -> None:
    prompt = _prompt(600)
    with LLM(str(tiny_model), dtype="float32", max_model_len=1024, max_num_batched_tokens=2048) as one:
        ref = one.prompt_logits([prompt])[0]
    with LLM(str(tiny_model), dtype="float32", max_model_len=1024, max_num_batched_tokens=64) as chunked:
        got = chunked.prompt_logits([prompt])[0]
        assert chunked.engine.num_used_blocks == 0
    assert got.shape == (600, ref.shape[1])
    assert (got - ref).abs().max().item() < 1e-4


def test_chunked_prefill_next_to_running_decodes(tiny_model) -> None:
    """A long prompt chunked while short requests decode in the same steps gives the same tokens."""
    prompts = [_prompt(600, 1), _prompt(5, 2), _prompt(40, 3)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_model), dtype="float32", max_model_len=1024) as one:
        ref = [o.token_ids for o in one.generate(prompts, sp)]
    with LLM(str(tiny_model), dtype="float32", max_model_len=1024, max_num_batched_tokens=48) as chunked:
        got = [o.token_ids for o in chunked.generate(prompts, sp)]
        assert chunked.engine.num_used_blocks == 0
    assert got == ref
