"""DP × PCP × PP on rank processes (gloo, CPU) gives what one process gives (issue 3's acceptance).

The reference is the in-process engine (PCP1) without chunking. Each topology runs a 607-token and a
7-token prompt for 8 greedy tokens with prompt and output logprobs, with the whole prompt in one step
and with chunked prefill (128-token budget, so the long prompt spans five steps next to decodes).
"""

from __future__ import annotations

import math

import pytest

from engine import LLM, SamplingParams

KW = dict(dtype="float32", device="cpu", max_model_len=1024)
PROMPTS = [[(i * 7 + 3) % 1000 + 2 for i in range(607)], [5, 9, 17, 33, 65, 129, 257]]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, prompt_logprobs=1)
TOPOLOGIES = {
    "pcp2": dict(pcp=2),
    "pcp4": dict(pcp=4),
    "pp2": dict(pp=2),
    "pp2-pcp2": dict(pp=2, pcp=2),
    "dp2-pcp2": dict(dp=2, pcp=2),
}


@pytest.fixture(scope="module")
def reference(tiny_model):
    with LLM(str(tiny_model), **KW) as llm:
        return llm.generate(PROMPTS, PARAMS)


def _close(a: list[float | None], b: list[float | None], tol: float = 1e-4) -> bool:
    assert len(a) == len(b)
    return all((x is None and y is None) or math.isclose(x, y, abs_tol=tol) for x, y in zip(a, b))


@pytest.mark.parametrize("budget", [2048, 128], ids=["one-step", "chunked"])
@pytest.mark.parametrize("topo", list(TOPOLOGIES), ids=list(TOPOLOGIES))
def test_topology_matches_pcp1(tiny_model, reference, topo, budget) -> None:
    with LLM(str(tiny_model), **KW, **TOPOLOGIES[topo], max_num_batched_tokens=budget) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        assert [e.num_used_blocks for e in llm.engines] == [0] * len(llm.engines)
        # DP: both replicas ran steps (one prompt each).
        assert all(e.executor.local_counts for e in llm.engines)
    for ref, out in zip(reference, outs):
        assert out.token_ids == ref.token_ids
        assert _close(out.logprobs, ref.logprobs)
        assert _close(out.prompt_logprobs, ref.prompt_logprobs)
        assert len(out.prompt_logprobs) == len(ref.prompt_token_ids)


SHARED = [(i * 11 + 5) % 1000 + 2 for i in range(200)]
CACHED_PROMPTS = [SHARED + [(i * k + 1) % 1000 + 2 for i in range(30 + 9 * k)] for k in range(1, 4)]
CACHED_PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)
# every topology above, PCP2 in both KV layouts
CACHED_TOPOLOGIES = {
    "pcp2-sharded": dict(pcp=2, kv_layout="sharded"),
    "pcp2-replicated": dict(pcp=2, kv_layout="replicated"),
    **{k: v for k, v in TOPOLOGIES.items() if k != "pcp2"},
}


@pytest.fixture(scope="module")
def cached_reference(tiny_model):
    with LLM(str(tiny_model), **KW) as llm:
        return llm.generate(CACHED_PROMPTS, CACHED_PARAMS)


@pytest.mark.parametrize("topo", list(CACHED_TOPOLOGIES), ids=list(CACHED_TOPOLOGIES))
def test_prefix_caching_on_rank_processes_matches_pcp1(tiny_model, cached_reference, topo) -> None:
    """Prompts sharing 200 tokens, twice (the second time every full block hits), chunked."""
    with LLM(str(tiny_model), **KW, **CACHED_TOPOLOGIES[topo], max_num_batched_tokens=128,
             enable_prefix_caching=True) as llm:
        for _ in range(2):
            outs = llm.generate(CACHED_PROMPTS, CACHED_PARAMS)
            for ref, out in zip(cached_reference, outs):
                assert out.token_ids == ref.token_ids
                assert _close(out.logprobs, ref.logprobs)
        caches = [e.prefix_cache for e in llm.engines]  # DP replicas each have their own
        assert all(c is not None for c in caches) and sum(c.hits for c in caches) > 0
        assert all(e.num_used_blocks == 0 for e in llm.engines) and sum(c.num_cached for c in caches) > 0
