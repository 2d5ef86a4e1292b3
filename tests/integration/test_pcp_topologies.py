"""DP × PCP × PP on rank processes (gloo, CPU) gives what one process gives (issue 3's acceptance).

The reference is the in-process engine (PCP1) without chunking. Each topology runs a 607-token and a
7-token prompt for 8 greedy tokens with prompt and output logprobs, with the whole prompt in one step
and with chunked prefill (128-token budget, so the long prompt spans five steps next to decodes); then,
in the chunked start, prompts sharing 200 tokens twice (prefix caching). The chunked starts are
``topology_runs.py``'s, shared with ``test_expert_parallel.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from topology_runs import CACHED_PARAMS, CACHED_PROMPTS, PARAMS, PROMPTS, Run

from engine import LLM

KW = dict(dtype="float32", device="cpu", max_model_len=1024)
ONE_STEP_TOPOLOGIES = {
    "pcp2": dict(pcp=2),
    "pcp4": dict(pcp=4),
    "pp2": dict(pp=2),
    "pp2-pcp2": dict(pp=2, pcp=2),
    "dp2-pcp2": dict(dp=2, pcp=2),
}
# every topology above (PCP2 in both KV layouts), and DP2 alone and DP2 x PCP2 replicated, which
# test_expert_parallel.py starts anyway
CHUNKED_TOPOLOGIES = ["pcp2-sharded", "pcp2-replicated", "pcp4", "pp2", "pp2-pcp2", "dp2", "dp2-pcp2-sharded",
                      "dp2-pcp2-replicated"]


@pytest.fixture(scope="module")
def reference(tiny_model):
    with LLM(str(tiny_model), **KW) as llm:
        return llm.generate(PROMPTS, PARAMS)


def _close(a: list[float | None], b: list[float | None], tol: float = 1e-4) -> bool:
    assert len(a) == len(b)
    return all((x is None and y is None) or math.isclose(x, y, abs_tol=tol) for x, y in zip(a, b))


def _matches(outs, reference) -> None:
    for ref, out in zip(reference, outs, strict=True):
        assert out.token_ids == ref.token_ids
        assert _close(out.logprobs, ref.logprobs)
        assert _close(out.prompt_logprobs, ref.prompt_logprobs)
        assert len(out.prompt_logprobs) == len(ref.prompt_token_ids)


@pytest.mark.parametrize("topo", list(ONE_STEP_TOPOLOGIES), ids=list(ONE_STEP_TOPOLOGIES))
def test_topology_matches_pcp1_in_one_step(tiny_model, reference, topo) -> None:
    with LLM(str(tiny_model), **KW, **ONE_STEP_TOPOLOGIES[topo], max_num_batched_tokens=2048) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        assert [e.num_used_blocks for e in llm.engines] == [0] * len(llm.engines)
        # DP: both replicas ran steps (one prompt each).
        assert all(e.executor.local_counts for e in llm.engines)
    _matches(outs, reference)


@pytest.mark.parametrize("topo", CHUNKED_TOPOLOGIES)
def test_topology_matches_pcp1_chunked(topology_runs: Callable[[str], Run], reference, topo) -> None:
    run = topology_runs(topo)
    assert run.used_blocks == [0] * len(run.used_blocks)
    assert all(run.local_counts)  # DP: both replicas ran steps (one prompt each)
    _matches(run.outputs, reference)


@pytest.fixture(scope="module")
def cached_reference(tiny_model):
    with LLM(str(tiny_model), **KW) as llm:
        return llm.generate(CACHED_PROMPTS, CACHED_PARAMS)


@pytest.mark.parametrize("topo", CHUNKED_TOPOLOGIES)
def test_prefix_caching_on_rank_processes_matches_pcp1(topology_runs: Callable[[str], Run], cached_reference,
                                                       topo) -> None:
    """Prompts sharing 200 tokens, twice (the second time every full block hits), chunked."""
    run = topology_runs(topo)
    for outs in run.cached:
        for ref, out in zip(cached_reference, outs, strict=True):
            assert out.token_ids == ref.token_ids
            assert _close(out.logprobs, ref.logprobs)
    assert len(run.cached) == 2 and run.cache_on and run.cache_hits > 0  # DP replicas each have their own cache
    assert run.cached_used_blocks == [0] * len(run.cached_used_blocks) and run.cached_blocks > 0
