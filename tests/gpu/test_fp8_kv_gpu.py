"""An FP8 KV cache on the GPU (``kv_cache_dtype`` fp8 / fp8_ds_mla, bf16 compute): the Triton decode kernel
reading quantized tiles, in eager steps and replayed from CUDA graphs, with chunked prefills over the
cached context and prefix hits, stays as close to the fp32 CPU engine with the same cache format as the
plain bf16 cache stays to the plain fp32 one (test_cuda_graphs.py's measure: greedy tokens followed,
logprob error over them)."""

from __future__ import annotations

import pytest
from test_cuda_graphs import KW, _first_diff, _requests

from engine import LLM

pytestmark = pytest.mark.gpu


def _follow(ref, got) -> tuple[int, float]:
    """Tokens ``got`` follows ``ref`` for in all, and its worst logprob error over them."""
    n_all, worst = 0, 0.0
    for r, g in zip(ref, got):
        n = _first_diff(r.token_ids, g.token_ids)
        n_all += n
        worst = max([worst, *(abs(a - b) for a, b in zip(r.logprobs[:n], g.logprobs[:n]))])
    return n_all, worst


@pytest.mark.parametrize("kv", ["fp8", "fp8_ds_mla"])
def test_an_fp8_cache_on_gpu_is_as_close_to_its_cpu_reference_as_bf16(tiny_model, kv: str) -> None:
    prompts, params = _requests()
    prompts = prompts + [prompts[7][:200] + [5, 6, 7]]  # a prefix hit on request 7's blocks
    params = params + [params[0]]
    follows = {}
    for name in ("auto", kv):
        with LLM(str(tiny_model), **{**KW, "device": "cpu", "dtype": "float32"}, kv_cache_dtype=name) as cpu:
            ref = cpu.generate(prompts, params)
        for mode, over in (("eager", {"enforce_eager": True}), ("graph", {})):
            with LLM(str(tiny_model), **KW, **over, kv_cache_dtype=name) as llm:
                graphs = llm.engine.executor.graphs
                assert (graphs is None) == (mode == "eager")
                got = llm.generate(prompts, params)
                if graphs is not None:
                    assert graphs.replays > 20
                assert llm.engine.num_used_blocks == 0
                assert llm.engine.load().prefix_hit_blocks > 0
            follows[name, mode] = _follow(ref, got)
    print(follows)
    for mode in ("eager", "graph"):
        n_plain, err_plain = follows["auto", mode]
        n, err = follows[kv, mode]
        assert n >= 0.5 * n_plain > 0, follows
        assert err <= 2 * err_plain + 0.05, follows
