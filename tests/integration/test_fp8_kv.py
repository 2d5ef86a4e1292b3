"""An FP8 KV cache (``kv_cache_dtype`` fp8 / fp8_ds_mla) through the engine: its tokens equal those of a
plain cache that holds each latent as the format gives it back (so every read and write path honours the
format, decode and cached-context prefill alike), in one process and on PCP / PP rank processes;
prefix caching hits in it; the stored rows are the format's; the cache holds as many more blocks as
its rows are smaller."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from engine_helpers import check_fp8_kv_pcp2_transfer, prefill_held, read_kv, round_trip_kv

from engine import LLM, SamplingParams

KW = dict(dtype="float32", device="cpu", max_model_len=1024, cpu_kv_cache_gb=0.05, max_num_batched_tokens=128)
PROMPTS = [[(i * 7 + 3) % 1000 + 2 for i in range(300)], [5, 9, 17, 33, 65, 129, 257]]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)
FORMATS = ("fp8", "fp8_ds_mla")
TOPOLOGIES = {
    "pcp2-sharded": dict(pcp=2, kv_layout="sharded"),
    "pcp2-replicated": dict(pcp=2, kv_layout="replicated"),
    "pp2-pcp2": dict(pp=2, pcp=2),
}


def same(outs, refs, tol: float = 1e-4) -> None:
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref.token_ids
        worst = max(abs(x - y) for x, y in zip(out.logprobs, ref.logprobs))
        assert worst <= tol, f"logprobs {worst:.2e} apart"


@pytest.fixture(scope="module", params=FORMATS)
def oracle(request: pytest.FixtureRequest, tiny_model: Path):
    """(format, the round-tripping plain cache's outputs, the plain cache's outputs), in one process."""
    name = request.param
    with LLM(str(tiny_model), **KW) as llm:  # chunked: cached-context prefill
        plain = llm.generate(PROMPTS, PARAMS)
    with LLM(str(tiny_model), **KW) as llm:  # its prefix cache: round-tripped rows
        eng = llm.engines[0]
        round_trip_kv(eng.model, replace(eng.config, kv_cache_dtype=name).kv_format(eng.model_config))
        return name, llm.generate(PROMPTS, PARAMS), plain

def test_an_fp8_cache_reads_and_writes_its_format_everywhere(tiny_model: Path, oracle) -> None:
    name, want, plain = oracle
    with LLM(str(tiny_model), **KW, kv_cache_dtype=name) as llm:
        same(llm.generate(PROMPTS, PARAMS), want, tol=1e-5)
        eng = llm.engines[0]
        assert eng.num_used_blocks == 0
        # The same memory holds as many more blocks as a row is smaller (float32 rows of 2304 bytes here).
        per_token = 16 * eng.model_config.num_hidden_layers
        assert eng.load().free_blocks == int(0.05 * 2**30 // (eng.config.kv_format(eng.model_config).row_bytes
                                                              * per_token))
        assert eng.config.kv_format(eng.model_config).row_bytes == {"fp8": 576, "fp8_ds_mla": 656}[name]
    # Quantization moved the logprobs well beyond the tolerances here (else the oracle proves nothing).
    assert any(not math.isclose(x, y, abs_tol=1e-2)
               for o, p in zip(want, plain) for x, y in zip(o.logprobs, p.logprobs))


@pytest.mark.parametrize("topo", list(TOPOLOGIES), ids=list(TOPOLOGIES))
def test_an_fp8_cache_on_rank_processes_equals_one_process(tiny_model: Path, oracle, topo: str) -> None:
    name, want, _ = oracle
    # Ranks compute latents in another order (1e-6 apart in float32); a rounding to e4m3 that flips then
    # moves a logprob by up to ~1.2e-3 (fp8's one scale; ~1e-4 with fp8_ds_mla's per-group ones).
    # Quantizing itself moves them by 2e-2 to 6e-2 here.
    with LLM(str(tiny_model), **KW, kv_cache_dtype=name, **TOPOLOGIES[topo]) as llm:
        same(llm.generate(PROMPTS, PARAMS), want, tol=5e-3)
        assert [e.num_used_blocks for e in llm.engines] == [0] * len(llm.engines)


@pytest.mark.parametrize("name", FORMATS)
def test_prefix_hits_in_an_fp8_cache_give_the_same_tokens(tiny_model: Path, name: str) -> None:
    """A prompt whose first 128 tokens hit the cache equals the same prompt run fresh in chunks of 128: both
    attend those tokens through the FP8 cache (a prompt computed in one chunk sees its own latents
    unquantized, so a hit is compared with the run that reads them back too)."""
    shared = [(i * 11 + 5) % 1000 + 2 for i in range(128)]
    first, second = shared + [7, 8, 9], shared + [40, 41, 42, 43]
    with LLM(str(tiny_model), **KW, kv_cache_dtype=name) as llm:
        llm.generate([first], PARAMS)
        hit = llm.generate([second], PARAMS)
        assert llm.engines[0].load().prefix_hit_blocks == 128 // 16
    with LLM(str(tiny_model), **KW, kv_cache_dtype=name) as llm:
        fresh = llm.generate([second], PARAMS)
        assert llm.engines[0].load().prefix_hit_blocks == 0
    same(hit, fresh, tol=1e-5)


@pytest.mark.parametrize("name", FORMATS)
def test_the_stored_rows_are_the_formats(tiny_model: Path, name: str) -> None:
    """Layer 0's latents depend on the prompt alone: a request's held KV in the FP8 cache is exactly the
    plain cache's rows through the format (read back through the ranks of a sharded PCP2 replica)."""
    prompt = PROMPTS[0]
    with LLM(str(tiny_model), **KW) as llm:
        eng = llm.engines[0]
        prefill_held(eng, prompt)
        plain = read_kv(eng, "r")[0]
        fmt = replace(eng.config, kv_cache_dtype=name).kv_format(eng.model_config)
    with LLM(str(tiny_model), **KW, kv_cache_dtype=name, pcp=2) as llm:
        eng = llm.engines[0]
        prefill_held(eng, prompt)
        got = read_kv(eng, "r")[0]
    assert got.shape == plain.shape == (len(prompt), 576)
    torch.testing.assert_close(got, fmt.decode(fmt.encode(plain)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", FORMATS)
def test_fp8_kv_through_a_pcp2_prefill_and_a_transfer_is_one_ranks(tiny_model: Path, name: str) -> None:
    """A PCP2 prefill's FP8 rows reach a decode engine through Mooncake byte for byte and equal one rank's but for
    flipped roundings (``engine_helpers.check_fp8_kv_pcp2_transfer``; on GPUs: tests/gpu/test_pcp_gpu.py)."""
    check_fp8_kv_pcp2_transfer(str(tiny_model), name, dtype="float32", device="cpu", max_model_len=1024,
                               num_kv_blocks=256)
