"""The whole cluster on one GPU, as `pdctl up` starts it: a prefill node and a decode node sharing cuda:0
(KV over Mooncake inside the device), the proxy in front. The decode node runs CUDA graphs with
overlapped decode steps (async_scheduling, on by default on GPUs), so this is the serving path of a GPU
deployment: concurrent streams, some ended early by a stop token (rows already launched past their end),
must give the tokens an in-process engine gives one step at a time, and free every block. fp32, so a request's logits do
not depend on its neighbours in a batch."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import cpu_tests
import openai
import pytest

from engine import LLM, SamplingParams
from pdctl.topology import Topology

pytestmark = pytest.mark.gpu

_e2e = cpu_tests.load("e2e/e2e_cluster.py")
NODE = dict(device="cuda:0", dtype="float32", max_model_len=1024, gpu_memory_utilization=0.15)


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
            cluster_run_dirs: list[Path]) -> Iterator:
    pytest.importorskip("mooncake.engine", reason="needs Mooncake (KV inside the GPU: nvlink_intra)")
    run_dir = tmp_path_factory.mktemp("gpu-cluster")
    topo = Topology.from_dict({
        "model": str(tiny_model),
        "served_model_name": "tiny",
        "registry": {"cluster": f"gpu-{run_dir.name}"},
        "proxy": {"port": 0, "admin_key": _e2e.ADMIN_KEY},
        "prefill": [{**NODE, "lease_s": 30}],
        "decode": [{**NODE, "max_num_seqs": 32}],
    })
    with _e2e.running_cluster(topo, run_dir, tiny_model, cluster_run_dirs) as c:
        yield c


def test_streams_through_a_gpu_cluster_equal_one_engine_and_free_every_block(cluster) -> None:
    prompts = [[(i * 13 + j * 7) % 1000 + 2 for j in range(5 + (i * 37) % 300)] for i in range(32)]
    max_tokens = [4 + (i * 5) % 40 for i in range(32)]
    with LLM(str(cluster.model), device="cuda", dtype="float32", max_model_len=1024, async_scheduling=False,
             gpu_memory_utilization=0.15) as llm:
        ref = llm.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                                     for m in max_tokens])
    # every third request stops at a token from the middle of its reference output
    stops = [r.token_ids[len(r.token_ids) // 2] if i % 3 == 0 and len(r.token_ids) > 2 else None
             for i, r in enumerate(ref)]
    with LLM(str(cluster.model), device="cuda", dtype="float32", max_model_len=1024, async_scheduling=False,
             gpu_memory_utilization=0.15) as llm:
        want = llm.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True,
                                                     stop_token_ids=[s] if s is not None else None)
                                      for m, s in zip(max_tokens, stops)])
    oa = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(i: int) -> list[int]:
        extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
        if stops[i] is not None:
            extra["stop_token_ids"] = [stops[i]]
        stream = await oa.completions.create(model="tiny", prompt=prompts[i], max_tokens=max_tokens[i],
                                             temperature=0, stream=True, logprobs=1, extra_body=extra)
        ids: list[int] = []
        async for ch in stream:
            if ch.choices and ch.choices[0].logprobs is not None:
                ids += [int(t.removeprefix("token_id:")) for t in ch.choices[0].logprobs.tokens]
        return ids

    async def all_() -> list[list[int]]:
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await oa.close()

    got = asyncio.run(all_())
    assert any(len(w.token_ids) < m for w, m in zip(want, max_tokens))  # some stopped early
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w.token_ids, f"request {i}"
    used = _e2e.wait_all_free(cluster)
    assert not any(used.values()), f"KV blocks still used after the streams: {used}"
