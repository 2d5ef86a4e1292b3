"""A block-FP8 checkpoint on rank processes gives exactly the greedy tokens of its dequantized twin on one
process, in the topologies nodes run (PCP2 with sharded KV, PP2 x PCP2, DP2): every rank loads and
dequantizes only its stage's layers, scales included."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from engine import LLM, SamplingParams

KW = dict(dtype="float32", device="cpu", max_model_len=1024)
PROMPTS = [[(i * 7 + 3) % 1000 + 2 for i in range(300)], [5, 9, 17, 33, 65, 129, 257]]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)
TOPOLOGIES = {
    "pcp2-sharded": dict(pcp=2, kv_layout="sharded"),
    "pp2-pcp2": dict(pp=2, pcp=2),
    "dp2": dict(dp=2),
}


@pytest.fixture(scope="module")
def reference(fp8_model: tuple[Path, Path]):
    with LLM(str(fp8_model[1]), **KW) as llm:  # the dequantized twin, in one process
        return llm.generate(PROMPTS, PARAMS)


@pytest.mark.parametrize("topo", list(TOPOLOGIES), ids=list(TOPOLOGIES))
def test_an_fp8_checkpoint_on_ranks_equals_its_dequantized_twin(fp8_model, reference, topo: str) -> None:
    with LLM(str(fp8_model[0]), **KW, **TOPOLOGIES[topo]) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        assert [e.num_used_blocks for e in llm.engines] == [0] * len(llm.engines)
    for ref, out in zip(reference, outs):
        assert out.token_ids == ref.token_ids
        assert all(math.isclose(x, y, abs_tol=1e-4) for x, y in zip(out.logprobs, ref.logprobs))
