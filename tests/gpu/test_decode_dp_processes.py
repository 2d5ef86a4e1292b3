"""A decode node's DP replicas as processes on GPUs: DP2 gives the same tokens as DP1 (and as the colocated
engine), its replicas run on their own GPUs, and a burst spread over both replicas completes and frees
every block.

The prefill side is an engine in the test process holding each request's KV on cuda:0, registered with
Mooncake (nvlink_intra, what GPU nodes on one host choose); the decode worker's replica processes pull
from it with their own transfer engines. Needs
2 GPUs and ``mooncake-transfer-engine-cuda13``; skipped otherwise.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from cluster.config import NodeConfig
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from cluster.wire import token_pb
from engine import LLM, SamplingParams
from engine.engine_config import EngineConfig
from kv_transfer.handle import KVSource, from_handle, to_handle
from kv_transfer.layout import describe_cache
from kv_transfer.protocol import choose_protocol

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
KW = dict(dtype="bfloat16", max_model_len=1024)
PROMPTS = [[(i * 7 + k) % 1000 + 2 for i in range(n)] for k, n in ((3, 150), (5, 40), (11, 300), (2, 17))]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


class Prefill:
    """A prefill engine on cuda:0 whose held KV is registered with a Mooncake transfer engine."""

    def __init__(self, model: Path) -> None:
        try:
            from kv_transfer.transports.mooncake import MooncakeTransport

            # the protocol a GPU node on this host picks (kv_protocol auto): nvlink_intra
            self.transport = MooncakeTransport(host="127.0.0.1", protocol=choose_protocol("auto", True, "127.0.0.1"))
        except (ImportError, RuntimeError, OSError) as e:
            pytest.skip(f"Mooncake is not usable here: {e}")
        self.llm = LLM(str(model), device="cuda:0", num_kv_blocks=512, enforce_eager=True, **KW)
        self.layout = describe_cache(self.transport.endpoint, self.llm.engine.cache_layers)
        self.transport.register(self.layout)

    def prefilled(self, rid: str, prompt: list[int]) -> tuple[pb.Token, KVSource]:
        pe = self.llm.engine
        seq = pe.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), request_id=rid, hold_kv=True)
        while pe.has_unfinished():
            pe.step()
        torch.cuda.synchronize()
        # Release goes to a closed port: the confirmer logs it and keeps the pulled KV (the test frees it)
        handle = to_handle(pe.kv_ownership(rid), len(pe.held[rid].block_ids), {0: self.layout}, node_id="p",
                           address="127.0.0.1:1", dp_rank=0, block_size=pe.config.block_size, lease_s=60.0,
                           kv_format=pe.config.kv_format(pe.model_config).wire_name)
        return token_pb(seq.output_token_ids[0]), from_handle(handle)

    def close(self) -> None:
        self.transport.close()
        self.llm.shutdown()


def worker_for(model: Path, dp: int):  # noqa: ANN201
    from decode_node.worker import DecodeWorker

    engine = EngineConfig(model=str(model), device="cuda:0", dp=dp, num_kv_blocks=512, **KW)
    cfg = NodeConfig(role="decode", node_id=f"d{dp}", engine=engine, transfer_timeout_s=30, dp_processes="on")
    return DecodeWorker(cfg, "127.0.0.1")


async def decode(worker, prefill: Prefill, rid: str, prompt: list[int], dp_rank: int) -> tuple[list[int], int]:  # noqa: ANN001
    from decode_node.replica import Job

    first, source = prefill.prefilled(rid, prompt)
    events: asyncio.Queue = asyncio.Queue()
    worker.submit(Job(rid, prompt, PARAMS, source, first.token_id), dp_rank, asyncio.get_running_loop(),
                  events.put_nowait)
    out, admitted_on = [first.token_id], -1
    try:
        while True:
            item = await asyncio.wait_for(events.get(), 120)
            if item is None:
                return out, admitted_on
            if isinstance(item, BaseException):
                raise item
            if item.HasField("admitted"):
                admitted_on = item.admitted.dp_rank
            out += [t.token_id for t in item.tokens.tokens]
    finally:
        prefill.llm.engine.release(rid)


async def burst(worker, prefill: Prefill) -> list[tuple[list[int], int]]:  # noqa: ANN001
    return await asyncio.gather(*(decode(worker, prefill, f"b{i}", PROMPTS[i % 4], -1) for i in range(8)))


def wait_free(worker, timeout_s: float = 10.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(r.used_blocks == 0 for r in worker.load()) and worker.in_flight() == 0:
            return True
        time.sleep(0.05)
    return False


def test_dp2_processes_equal_dp1_and_colocated(tiny_model: Path) -> None:
    with LLM(str(tiny_model), device="cuda:0", num_kv_blocks=512, **KW) as colocated:
        want = [colocated.generate([p], PARAMS)[0].token_ids for p in PROMPTS]
    prefill = Prefill(tiny_model)
    got: dict[int, list[list[int]]] = {}
    try:
        for dp in (1, 2):
            worker = worker_for(tiny_model, dp)
            try:
                assert len(worker.pids()) == dp  # one process per replica
                outs = []
                for i, p in enumerate(PROMPTS):  # one at a time, alternating replicas: batch 1 everywhere
                    toks, on = asyncio.run(decode(worker, prefill, f"r{dp}-{i}", p, i % dp))
                    assert on == i % dp
                    outs.append(toks)
                got[dp] = outs
                assert wait_free(worker)
                if dp == 2:  # a burst over both replicas
                    results = asyncio.run(burst(worker, prefill))
                    assert all(len(t) == PARAMS.max_tokens for t, _ in results)
                    assert {on for _, on in results} == {0, 1}, "the burst used both replicas"
                    assert wait_free(worker)
                    _, nbytes, _, _ = worker.transfers()
                    assert nbytes > 0
            finally:
                worker.shutdown()
        assert prefill.llm.engine.num_used_blocks == 0
    finally:
        prefill.close()
    assert got[2] == got[1], "DP2 (processes) differs from DP1"
    assert got[1] == want, "disaggregated decode differs from the colocated engine"
