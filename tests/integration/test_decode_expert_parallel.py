"""Expert parallelism across a decode node's DP replicas (wide-EP decode): the replica processes are one
gloo group, each holds half the routed experts, and they step in lockstep by waves (``decode_node.waves``).

The prefill side is an engine in the test process whose held KV is registered with Mooncake (tcp); the
decode worker's replica processes pull it with their own transfer engines, as a decode node's do. Greedy
tokens and logprobs equal the colocated engine with EP off, with steps and overlapped steps, when one
replica has no requests for many steps while the other works, when a request arrives at one replica in the
middle of the other's wave, with requests the decode node prefills itself, and when one request is aborted
mid-wave. Faults: a replica SIGKILLed
or SIGSTOPped mid-decode fails the node within the group's timeout, and every stream ends with an error.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from decode_helpers import decoded
from procs import wait_until

from cluster.config import NodeConfig
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from decode_node.replica import Job
from decode_node.worker import DecodeWorker
from engine import LLM, SamplingParams
from engine.engine_config import EngineConfig
from kv_transfer.handle import KVSource, from_handle, to_handle
from kv_transfer.layout import describe_cache

KW = dict(dtype="float32", device="cpu", max_model_len=1024, max_num_batched_tokens=128)
PROMPTS = [[(i * 7 + 3) % 1000 + 2 for i in range(150)], [5, 9, 17], [(i * 11 + 5) % 1000 + 2 for i in range(70)],
           [4, 8, 15, 16, 23, 42]]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, logprobs=1, ignore_eos=True)
LONG = SamplingParams(max_tokens=40, temperature=0.0, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module")
def want(tiny_model: Path) -> dict[str, list[tuple[list[int], list[float]]]]:
    """Colocated, EP off: each prompt with PARAMS and with LONG."""
    with LLM(str(tiny_model), **KW) as llm:
        return {name: [(o.token_ids, o.logprobs) for o in llm.generate(PROMPTS, p)]
                for name, p in (("short", PARAMS), ("long", LONG))}


class Prefill:
    """A prefill engine in this process, its held KV registered with a Mooncake transfer engine (tcp)."""

    def __init__(self, model: Path) -> None:
        from kv_transfer.transports.mooncake import MooncakeTransport

        self.transport = MooncakeTransport(host="127.0.0.1", protocol="tcp")
        self.llm = LLM(str(model), num_kv_blocks=256, **KW)
        self.layout = describe_cache(self.transport.endpoint, self.llm.engine.cache_layers)
        self.transport.register(self.layout)
        self.lock = threading.Lock()

    def prefilled(self, rid: str, prompt: list[int]) -> tuple[pb.Token, KVSource]:
        with self.lock:
            pe = self.llm.engine
            seq = pe.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=1), request_id=rid,
                                 hold_kv=True)
            while pe.has_unfinished():
                pe.step()
            # Release goes to a closed port: the confirmer takes an unreachable prefill node as confirmed.
            handle = to_handle(pe.kv_ownership(rid), len(pe.held[rid].block_ids), {0: self.layout}, node_id="p",
                               address="127.0.0.1:1", dp_rank=0, block_size=pe.config.block_size, lease_s=60.0,
                               kv_format=pe.config.kv_format(pe.model_config).wire_name)
            return pb.Token(token_id=seq.output_token_ids[0], logprob=seq.logprobs[0]), from_handle(handle)

    def release_all(self) -> None:
        with self.lock:
            for rid in list(self.llm.engine.held):
                self.llm.engine.release(rid)

    def close(self) -> None:
        self.transport.close()
        self.llm.shutdown()


@pytest.fixture(scope="module")
def prefill(tiny_model: Path) -> Iterator[Prefill]:
    p = Prefill(tiny_model)
    yield p
    p.close()


def ep_worker(model: Path, ep: bool = True, overlap: bool = True, **engine: object) -> DecodeWorker:
    ec = EngineConfig(model=str(model), dp=2, enable_expert_parallel=ep, num_kv_blocks=128, async_scheduling=overlap,
                      **{**KW, **engine})
    return DecodeWorker(NodeConfig(role="decode", node_id="d", engine=ec, dp_processes="on"), "127.0.0.1")


async def decode(worker: DecodeWorker, rid: str, prompt: list[int], params: SamplingParams, dp_rank: int,
                 prefill: Prefill | None) -> tuple[list[int], list[float]]:
    """One request through the worker (pulled from ``prefill``, or prefilled on the replica when None):
    its tokens and logprobs, or the exception that ended it."""
    if prefill is None:
        return await decoded(worker, Job(rid, prompt, params, None), dp_rank)
    first, source = prefill.prefilled(rid, prompt)
    ids, lps = await decoded(worker, Job(rid, prompt, params, source, first.token_id, first.logprob), dp_rank)
    return [first.token_id, *ids], [first.logprob, *lps]


def same(got: tuple[list[int], list[float]], want: tuple[list[int], list[float]]) -> None:
    assert got[0] == want[0]
    # The same products summed in another order (per choice, then over the group): fp32 rounding.
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(got[1], want[1]))


@pytest.fixture(scope="module")
def full_expert_params(tiny_model: Path) -> list[int]:
    """The routed experts' parameters each replica process of an EP-off worker holds (one start for the module)."""
    off = ep_worker(tiny_model, ep=False)
    try:
        return off.expert_params
    finally:
        off.shutdown()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "steps"])
def test_ep_decode_replicas_equal_ep_off(tiny_model: Path, prefill: Prefill, want, full_expert_params: list[int],
                                         overlap: bool) -> None:
    worker = ep_worker(tiny_model, overlap=overlap)
    try:
        async def scenarios() -> None:
            # one request on each replica at once; the short one ends long before the long one, and its replica
            # keeps stepping without rows for the other's remaining steps
            a, b = await asyncio.gather(decode(worker, "a", PROMPTS[0], LONG, 0, prefill),
                                        decode(worker, "b", PROMPTS[1], PARAMS, 1, prefill))
            same(a, want["long"][0])
            same(b, want["short"][1])
            # replica 1 alone, replica 0 idle for all its steps
            same(await decode(worker, "c", PROMPTS[2], PARAMS, 1, prefill), want["short"][2])
            # a request joins replica 1 in the middle of replica 0's wave
            first = asyncio.create_task(decode(worker, "d", PROMPTS[3], LONG, 0, prefill))
            await asyncio.sleep(0.3)
            assert not first.done()
            late = await decode(worker, "e", PROMPTS[0], PARAMS, 1, prefill)
            same(await first, want["long"][3])
            same(late, want["short"][0])
            # requests the decode node prefills itself (local prefill: prefill and decode rows in lockstep)
            local = await asyncio.gather(decode(worker, "f", PROMPTS[2], PARAMS, 0, None),
                                         decode(worker, "g", PROMPTS[0], PARAMS, 1, None))
            for got, i in zip(local, (2, 0)):
                same(got, want["short"][i])
            # one request aborted mid-wave; the other replica's request goes on untouched
            endless = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
            gone = asyncio.create_task(decode(worker, "h", PROMPTS[1], endless, 0, prefill))
            kept = asyncio.create_task(decode(worker, "i", PROMPTS[3], LONG, 1, prefill))
            await asyncio.sleep(0.5)
            worker.abort("h")
            with pytest.raises(RuntimeError, match="aborted"):
                await gone
            same(await kept, want["long"][3])

        asyncio.run(scenarios())
        assert not worker.failed.is_set()
        wait_until(lambda: all(r.used_blocks == 0 and r.running == 0 for r in worker.load()), 10,
                   "every replica's blocks to be free")
        # Each replica holds half the routed experts, as its loaded modules say.
        assert full_expert_params[0] > 0 and worker.expert_params == [full_expert_params[0] // 2] * 2
    finally:
        worker.shutdown()
        prefill.release_all()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
def test_a_dead_or_hung_replica_fails_the_ep_group_within_its_timeout(tiny_model: Path, prefill: Prefill,
                                                                      sig: signal.Signals) -> None:
    """Mid-decode on both replicas, one replica process is killed (the node sees it gone at once) or stopped
    (its peer waits in a collective until the group's timeout, ``rank_timeout_s``: 15 s, which also bounds
    the replicas' start): the node fails, both streams end with an error, and the node shuts down without
    waiting on the stopped process."""
    worker = ep_worker(tiny_model, rank_timeout_s=15.0)
    victim = worker.pids()[1]
    endless = SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
    try:
        async def run() -> tuple[list, float]:
            calls = [asyncio.create_task(decode(worker, rid, PROMPTS[i], endless, i, prefill))
                     for i, rid in enumerate(("x", "y"))]
            await asyncio.sleep(1.0)  # both decoding
            assert not any(c.done() for c in calls)
            t0 = time.monotonic()
            os.kill(victim, sig)
            results = await asyncio.gather(*calls, return_exceptions=True)
            return results, t0

        results, t0 = asyncio.run(run())
        assert all(isinstance(r, BaseException) for r in results), results
        # stopped: the collective's 15 s, then the group's shutdown (the stopped process is killed: ~5 s)
        assert worker.failed.is_set() and time.monotonic() - t0 < (10 if sig == signal.SIGKILL else 15 + 15)
        # killed: the node sees the process gone; stopped: its peer's collective timed out
        assert ("rank 1" if sig == signal.SIGKILL else "Timed out") in (worker.failure or ""), worker.failure
    finally:
        t1 = time.monotonic()
        worker.shutdown()
        assert time.monotonic() - t1 < 30
        prefill.release_all()


def test_ep_decode_is_refused_on_threads_and_with_experts_that_do_not_divide(tiny_model: Path) -> None:
    ec = EngineConfig(model=str(tiny_model), dp=2, enable_expert_parallel=True, **KW)
    with pytest.raises(ValueError, match="dp_processes must be on or auto"):
        NodeConfig(role="decode", node_id="d", engine=ec, dp_processes="off")
    ec = EngineConfig(model=str(tiny_model), dp=3, enable_expert_parallel=True, **KW)
    with pytest.raises(ValueError, match="do not divide over 3 EP ranks"):
        DecodeWorker(NodeConfig(role="decode", node_id="d", engine=ec), "127.0.0.1")
