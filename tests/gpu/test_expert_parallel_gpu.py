"""Expert parallelism on GPUs (NCCL, one rank or replica per GPU): the same greedy tokens as EP off.

- a prefill-style engine with PCP2 and EP2 (the MoE layers' all-gather and reduce-scatter over NCCL);
- DP2 with EP2 across the replicas (lockstep, the row counts exchanged over NCCL each step);
- a decode worker's two replica processes as one EP group (NCCL for the MoE layers, gloo for the per-step
  agreement), decoding requests it prefills itself, one replica idle while the other works;
- FP8 experts under EP (each rank holds its half in e4m3) against FP8 experts on one GPU.

fp32 activations on the tiny model, so the comparison is exact up to summation order. Needs 2 GPUs.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from decode_helpers import decoded

from engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]
PROMPTS = [[(i * 7 + 3) % 1000 + 2 for i in range(607)], [5, 9, 17, 33, 65, 129, 257], [4, 8, 15, 16, 23, 42]]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1, ignore_eos=True)
GPU = dict(dtype="float32", device="cuda", max_model_len=1024, num_kv_blocks=256, max_num_batched_tokens=128)


def _same(got: list[tuple[list[int], list[float]]], want: list[tuple[list[int], list[float]]]) -> None:
    for (g_ids, g_lp), (w_ids, w_lp) in zip(got, want, strict=True):
        assert g_ids == w_ids
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(g_lp, w_lp))


@pytest.fixture(scope="module")
def want(tiny_model: Path) -> list[tuple[list[int], list[float]]]:
    with LLM(str(tiny_model), **GPU) as one:
        return [(o.token_ids, o.logprobs) for o in one.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("topo", [dict(pcp=2), dict(dp=2)], ids=["pcp2-ep2", "dp2-ep2"])
def test_ep_ranks_on_gpus_equal_ep_off(tiny_model: Path, want, topo: dict) -> None:
    with LLM(str(tiny_model), **GPU, **topo, enable_expert_parallel=True) as llm:
        got = [(o.token_ids, o.logprobs) for o in llm.generate(PROMPTS, PARAMS)]
        assert llm.node is not None and len(set(llm.node.expert_params)) == 1
    _same(got, want)


def test_ep_decode_replicas_on_gpus_equal_ep_off(tiny_model: Path, want) -> None:
    from cluster.config import NodeConfig
    from decode_node.replica import Job
    from decode_node.worker import DecodeWorker
    from engine.engine_config import EngineConfig

    ec = EngineConfig(model=str(tiny_model), device="cuda:0", dp=2, enable_expert_parallel=True,
                      **{k: v for k, v in GPU.items() if k != "device"})
    worker = DecodeWorker(NodeConfig(role="decode", node_id="d", engine=ec), "127.0.0.1")

    async def one(rid: str, prompt: list[int], d: int) -> tuple[list[int], list[float]]:
        return await decoded(worker, Job(rid, prompt, PARAMS, None), d, timeout_s=120)

    async def run() -> list[tuple[list[int], list[float]]]:
        both = await asyncio.gather(one("a", PROMPTS[0], 0), one("b", PROMPTS[1], 1))
        return [*both, await one("c", PROMPTS[2], 1)]  # replica 0 idle throughout

    try:
        got = asyncio.run(run())
        assert not worker.failed.is_set()
        assert worker.expert_params[0] == worker.expert_params[1] > 0
    finally:
        worker.shutdown()
    _same(got, want)


def test_fp8_experts_under_ep_equal_fp8_experts_without(fp8_model: tuple[Path, Path]) -> None:
    """FP8 weights and EP compose: each of two ranks holds half the routed experts in e4m3 (the fused W8A8
    kernels run on the choices gathered for them) and the tokens equal the FP8 model on one GPU."""
    with LLM(str(fp8_model[0]), **GPU) as one:
        want = [(o.token_ids, o.logprobs) for o in one.generate(PROMPTS, PARAMS)]
    with LLM(str(fp8_model[0]), **GPU, pcp=2, enable_expert_parallel=True) as llm:
        got = [(o.token_ids, o.logprobs) for o in llm.generate(PROMPTS, PARAMS)]
        held = llm.node.expert_params if llm.node is not None else []
    with LLM(str(fp8_model[0]), **GPU, pcp=2) as full:
        whole = full.node.expert_params if full.node is not None else []
    assert held and held == [n // 2 for n in whole]
    _same(got, want)
