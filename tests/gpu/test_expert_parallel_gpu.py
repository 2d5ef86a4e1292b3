"""Expert parallelism on GPUs (NCCL, one rank or replica per GPU): the same greedy tokens as EP off.

- a prefill-style engine with PCP2 and EP2 (the MoE layers' all-gather and reduce-scatter over NCCL);
- DP2 with EP2 across the replicas (lockstep, the row counts exchanged over NCCL each step);
- a decode worker's two replica processes as one EP group (NCCL for the MoE layers, gloo for the per-step
  agreement), decoding requests it prefills itself, one replica idle while the other works;
- FP8 experts under EP (each rank holds its half in e4m3) against FP8 experts on one GPU;
- CUDA graphs under EP: the decode replicas capture the same ladder in lockstep and replay one padded size
  per step (bf16, against the fp32 CPU reference as far as eager decoding is, as test_cuda_graphs.py).

fp32 activations on the tiny model, so the comparison is exact up to summation order (the decode replicas
replay CUDA graphs there too). Needs 2 GPUs.
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


def test_ep_decode_graphs_on_gpus_as_close_to_fp32_as_eager(tiny_model: Path, capfd: pytest.CaptureFixture) -> None:
    """A decode node's two replica processes on two GPUs as one EP group with CUDA graphs (bf16): each captures
    the ladder (1..16 rows) in lockstep with the other and every step replays one size on both, the group's
    largest step padded (one replica decoding 5 requests beside the other's 2, then one alone while the other
    has no rows, and a request joining mid-way). Against the fp32 CPU reference, over each request's tokens up
    to where either leaves the reference's greedy tokens, the graphs' logprob error is at most twice eager's
    plus 0.05, and they follow the reference at least half as far as eager decoding does."""
    from cluster.config import NodeConfig
    from decode_node.replica import Job
    from decode_node.worker import DecodeWorker
    from engine.engine_config import EngineConfig

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 900, (n,), generator=g).tolist() for n in (5, 17, 40, 9, 3, 64, 12, 30)]
    params = [SamplingParams(max_tokens=6 + 4 * i, temperature=0.0, logprobs=1, ignore_eos=True)
              for i in range(len(prompts))]
    kw = dict(max_model_len=512, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=96,
              max_cudagraph_capture_size=16)
    with LLM(str(tiny_model), device="cpu", dtype="float32", **kw) as cpu:
        ref = [(o.token_ids, o.logprobs) for o in cpu.generate(prompts, params)]

    def decode_node(**over: object) -> list[tuple[list[int], list[float]]]:
        ec = EngineConfig(model=str(tiny_model), device="cuda:0", dtype="bfloat16", dp=2, enable_expert_parallel=True,
                          **kw, **over)  # type: ignore[arg-type]
        worker = DecodeWorker(NodeConfig(role="decode", node_id="d", engine=ec), "127.0.0.1")

        async def one(i: int, d: int) -> tuple[list[int], list[float]]:
            return await decoded(worker, Job(f"r{i}", prompts[i], params[i], None), d, timeout_s=120)

        async def run() -> list[tuple[list[int], list[float]]]:
            first = asyncio.gather(*(one(i, 0) for i in range(5)), *(one(i, 1) for i in (5, 6)))
            await asyncio.sleep(0.5)
            late = one(7, 1)  # joins replica 1 while replica 0's requests decode
            both = await asyncio.gather(first, late)
            alone = await one(0, 1)  # replica 0 without rows throughout: it replays padding only
            return [*both[0], both[1], alone]

        try:
            out = asyncio.run(run())
            assert not worker.failed.is_set()
        finally:
            worker.shutdown()
        return out

    eager = decode_node(enforce_eager=True)
    capfd.readouterr()
    graphed = decode_node()
    logs = capfd.readouterr().err
    assert logs.count("captured CUDA graphs of token rows for 5 sizes") == 2, logs[-3000:]  # both replicas
    assert "CUDA graphs disabled" not in logs
    want = [*ref, ref[0]]
    followed = {"eager": 0, "graph": 0}
    for i, (r, e, o) in enumerate(zip(want, eager, graphed, strict=True)):
        ne, ng = _first_diff(r[0], e[0]), _first_diff(r[0], o[0])
        followed["eager"] += ne
        followed["graph"] += ng
        n = min(ne, ng)
        err_e = max((abs(a - b) for a, b in zip(r[1][:n], e[1][:n])), default=0.0)
        err_g = max((abs(a - b) for a, b in zip(r[1][:n], o[1][:n])), default=0.0)
        assert err_g <= 2 * err_e + 0.05, (i, n, err_g, err_e)
    assert followed["graph"] >= 0.5 * followed["eager"] > 0, followed


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
