"""PCP and PP on GPUs (NCCL, one rank per GPU): the same results as one GPU. Needs 2 GPUs."""

from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]
PROMPTS = [[(i * 7 + 3) % 1000 + 2 for i in range(607)], [5, 9, 17, 33, 65, 129, 257]]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, prompt_logprobs=1)
GPU = dict(device="cuda", max_model_len=1024, num_kv_blocks=256)


@pytest.mark.parametrize("topo", [dict(pcp=2), dict(pp=2), dict(pcp=2, kv_layout="replicated")],
                         ids=["pcp2", "pp2", "pcp2-replicated"])
def test_fp32_topology_matches_one_gpu(tiny_model, topo) -> None:
    with LLM(str(tiny_model), dtype="float32", **GPU) as one:
        ref = one.generate(PROMPTS, PARAMS)
    with LLM(str(tiny_model), dtype="float32", **GPU, **topo, max_num_batched_tokens=128) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        assert llm.engine.num_used_blocks == 0
    for r, o in zip(ref, outs):
        assert o.token_ids == r.token_ids
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(o.logprobs, r.logprobs))
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(o.prompt_logprobs[1:], r.prompt_logprobs[1:]))


def test_bf16_pcp2_flash_path_matches_fp32_cpu(tiny_model) -> None:
    prompts = [p for p in PROMPTS]
    with LLM(str(tiny_model), dtype="float32", device="cpu", max_model_len=1024) as cpu:
        ref = cpu.prompt_logits(prompts)
    for budget in (2048, 64):
        with LLM(str(tiny_model), dtype="bfloat16", **GPU, pcp=2, max_num_batched_tokens=budget) as llm:
            got = llm.prompt_logits(prompts)
        for g, r in zip(got, ref):
            assert float((g - r).norm() / r.norm()) < 2e-2


@pytest.mark.parametrize("kv", ["fp8", "fp8_ds_mla"])
def test_fp8_kv_through_a_pcp2_prefill_and_a_transfer_is_one_gpus(tiny_model, kv: str) -> None:
    """An FP8 cache's rows from a PCP2 prefill (one rank per GPU) arrive on a decode GPU through Mooncake byte for
    byte and equal one GPU's but for flipped roundings (``engine_helpers.check_fp8_kv_pcp2_transfer``; the same
    on CPU: tests/integration/test_fp8_kv.py)."""
    from engine_helpers import check_fp8_kv_pcp2_transfer

    check_fp8_kv_pcp2_transfer(str(tiny_model), kv, **dict(GPU, dtype="float32"))
