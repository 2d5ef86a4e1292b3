"""The decode node's worker with the fake transport: pulls off the engine thread, continuous
batching, and what happens to the blocks when a pull fails, times out, or is aborted mid-pull."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path

import pytest

from cluster.config import NodeConfig
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from cluster.wire import token_pb
from decode_node.replica import Job
from decode_node.service import coalesced
from decode_node.worker import DecodeWorker
from engine import LLM, SamplingParams
from engine.engine_config import EngineConfig
from kv_transfer.handle import from_handle, to_handle
from kv_transfer.handoff import KVLost
from kv_transfer.layout import describe_cache
from kv_transfer.transport import TransferError
from kv_transfer.transports.fake import Fabric
from pdctl.tiny_model import make_tiny_model

KW = dict(dtype="float32", device="cpu", max_model_len=512)
PROMPTS = [[(i * 7 + k) % 1000 + 2 for i in range(n)] for k, n in ((3, 150), (5, 40))]


@pytest.fixture(scope="module")
def want(tiny_model: Path) -> list[list[int]]:
    with LLM(str(tiny_model), **KW) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0))]


class Setup:
    """An in-process prefill engine and a decode worker on one fake fabric."""

    def __init__(self, model: Path, timeout_s: float, lease_s: float = 30.0, overlap: bool | None = None,
                 **decode_kw: object) -> None:
        self.fabric = Fabric()
        self.lease_s = lease_s
        self.lock = threading.Lock()  # the prefill engine is used from the test and the pull threads
        self.confirmed: list[str] = []
        self.prefill = LLM(str(model), **KW)
        pe = self.prefill.engine
        src = self.fabric.transport("prefill")
        self.layout = describe_cache("prefill", pe.executor.cache.layers)
        src.register(self.layout)
        engine = EngineConfig(model=str(model), num_kv_blocks=64, async_scheduling=overlap, **KW,
                              **decode_kw)  # type: ignore[arg-type]
        cfg = NodeConfig(role="decode", node_id="d", engine=engine, transfer_timeout_s=timeout_s)
        self.worker = DecodeWorker(cfg, "127.0.0.1", transport=self.fabric.transport("decode"), confirm=self.confirm)
        self.engine = self.worker.replicas[0].replica.engine

    def confirm(self, address: str, rid: str) -> bool:
        """What PrefillService.Release does: free the held blocks; False if they were not held."""
        with self.lock:
            self.confirmed.append(rid)
            return self.prefill.engine.release(rid)

    def prefilled(self, rid: str, prompt: list[int]) -> tuple[pb.Token, pb.KVHandle]:
        with self.lock:
            pe = self.prefill.engine
            seq = pe.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), request_id=rid, hold_kv=True)
            while pe.has_unfinished():
                pe.step()
            handle = to_handle(pe.kv_ownership(rid), len(pe.held[rid].block_ids), {0: self.layout}, node_id="p",
                               address="", dp_rank=0, block_size=16, lease_s=self.lease_s,
                               kv_format=pe.config.kv_format(pe.model_config).wire_name)
            return token_pb(seq.output_token_ids[0]), handle

    async def decode(self, rid: str, prompt: list[int], abort_after_s: float | None = None) -> list:
        first, handle = self.prefilled(rid, prompt)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        job = Job(rid, prompt, SamplingParams(max_tokens=6, temperature=0.0), from_handle(handle), first.token_id)
        self.worker.submit(job, -1, loop, queue.put_nowait)
        if abort_after_s is not None:
            await asyncio.sleep(abort_after_s)
            self.worker.abort(rid)
        events = []
        while True:
            item = await asyncio.wait_for(queue.get(), 20)
            events.append(item)
            if item is None or isinstance(item, BaseException):
                return events

    def close(self) -> None:
        self.worker.shutdown()
        self.prefill.shutdown()


def tokens(first: int, events: list) -> list[int]:
    out = [first]
    for e in events:
        if isinstance(e, pb.DecodeEvent) and e.HasField("tokens"):
            out += [t.token_id for t in e.tokens.tokens]
    return out


def wait_used(engine, n: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while engine.num_used_blocks != n and time.monotonic() < deadline:
        time.sleep(0.02)
    return engine.num_used_blocks == n


# Overlapped steps (async_scheduling) are what GPU nodes run by default; a CPU's default is off.
@pytest.mark.parametrize("overlap", [False, True], ids=["steps", "overlapped"])
def test_two_requests_decode_together_and_equal_colocated(tiny_model: Path, want, overlap: bool) -> None:
    s = Setup(tiny_model, timeout_s=10, overlap=overlap)
    try:
        async def both() -> list[list]:
            return await asyncio.gather(s.decode("a", PROMPTS[0]), s.decode("b", PROMPTS[1]))

        got = asyncio.run(both())
        for prompt_events, expected in zip(got, want):
            assert prompt_events[0].HasField("admitted") and prompt_events[-1] is None
            assert tokens(expected[0], prompt_events) == expected
            assert prompt_events[-2].tokens.finish_reason == "length"
        assert wait_used(s.engine, 0)
        assert sorted(s.confirmed) == ["a", "b"] and s.prefill.engine.num_used_blocks == 0
        assert (s.engine.overlapped_steps > 0) == overlap
    finally:
        s.close()


def test_a_timed_out_pull_keeps_its_blocks_quarantined_then_frees_them(tiny_model: Path) -> None:
    s = Setup(tiny_model, timeout_s=0.3)
    s.fabric.delay_s = 0.5  # every batch outlasts the timeout: the bytes "may still land"
    try:
        t0 = time.monotonic()
        events = asyncio.run(s.decode("a", PROMPTS[0]))
        assert isinstance(events[-1], TransferError) and events[-1].cause == "timeout"
        assert time.monotonic() - t0 < 2
        assert s.engine.num_used_blocks == 10  # 150 tokens in 16-token blocks, kept for one more timeout
        assert wait_used(s.engine, 0, timeout_s=2)
        assert s.worker.transfers()[3]["timeout"] == 1  # failures by cause
    finally:
        s.close()


def test_a_dead_source_fails_the_pull_and_its_blocks_are_quarantined_too(tiny_model: Path) -> None:
    s = Setup(tiny_model, timeout_s=0.5)
    s.fabric.kill("prefill")
    try:
        events = asyncio.run(s.decode("a", PROMPTS[0]))
        assert isinstance(events[-1], TransferError) and events[-1].cause == "peer_gone"
        # Batches to other sources could still be writing: the blocks wait one timeout period.
        assert s.engine.num_used_blocks == 10
        assert wait_used(s.engine, 0, timeout_s=2)
        assert not s.confirmed
    finally:
        s.close()


def test_kv_the_prefill_node_no_longer_held_is_not_decoded(tiny_model: Path) -> None:
    s = Setup(tiny_model, timeout_s=5)
    try:
        first, handle = s.prefilled("a", PROMPTS[0])
        with s.lock:
            assert s.prefill.engine.release("a")  # the lease ran out during the pull

        async def run() -> list:
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()
            job = Job("a", PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.0), from_handle(handle),
                      first.token_id)
            s.worker.submit(job, -1, loop, queue.put_nowait)
            return [await asyncio.wait_for(queue.get(), 20)]

        (err,) = asyncio.run(run())
        assert isinstance(err, KVLost)
        assert wait_used(s.engine, 0, timeout_s=1)  # nothing is in flight any more: freed at once
    finally:
        s.close()


def test_a_pull_may_not_outlast_half_the_lease(tiny_model: Path) -> None:
    s = Setup(tiny_model, timeout_s=5, lease_s=0.4)
    s.fabric.delay_s = 0.3  # more than half of the 0.4 s lease
    try:
        events = asyncio.run(s.decode("a", PROMPTS[0]))
        assert isinstance(events[-1], TransferError) and events[-1].cause == "timeout"
        assert not s.confirmed
    finally:
        s.close()


def test_abort_during_the_pull_frees_the_blocks_when_it_returns(tiny_model: Path) -> None:
    s = Setup(tiny_model, timeout_s=5)
    s.fabric.delay_s = 0.4
    try:
        events = asyncio.run(s.decode("a", PROMPTS[0], abort_after_s=0.1))
        assert isinstance(events[-1], Exception) and not any(
            isinstance(e, pb.DecodeEvent) and e.HasField("tokens") for e in events)
        assert wait_used(s.engine, 0)
        assert not s.engine.has_unfinished()
    finally:
        s.close()


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "no-recompute"])
def test_a_decode_node_with_mtp_fed_by_a_prefill_node_without_it(tmp_path_factory: pytest.TempPathFactory,
                                                                  caplog: pytest.LogCaptureFixture,
                                                                  recompute: bool) -> None:
    """The decode node runs MTP, the prefill node does not (its handle lacks the MTP layer's KV). With
    ``mtp_recompute`` the replica pulls nothing, releases the prefill node's blocks at once, and the engine
    computes the prompts again and drafts; off, it pulls and decodes without drafts. The answers are the same,
    and the replica says which, once for the prefill node."""
    model = make_tiny_model(tmp_path_factory.mktemp("mtp") / "v3-mtp", arch="v3", moe=True, seed=7, mtp_layers=1)
    with LLM(str(model), **KW) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0))]
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    s = Setup(model, timeout_s=10, speculative_config=spec, mtp_recompute=recompute)
    try:
        with caplog.at_level(logging.INFO, logger="pdcluster.decode"):
            got = [asyncio.run(s.decode(rid, p)) for rid, p in zip("ab", PROMPTS)]
        for events, expected in zip(got, want):
            assert tokens(expected[0], events) == expected
            assert (events[0].admitted.transfer_bytes == 0) == recompute  # nothing pulled
        said = [r.getMessage() for r in caplog.records if "sends no MTP layer KV" in r.getMessage()]
        assert len(said) == 1 and ("computes the MTP layer's KV itself" in said[0]) == recompute
        assert (s.engine.spec_counts.steps > 0) == recompute
        assert s.confirmed == ["a", "b"] and s.prefill.engine.num_used_blocks == 0  # released either way
        assert wait_used(s.engine, 0)
    finally:
        s.close()


def _tokens(*ids: int, finish: str = "") -> pb.DecodeEvent:
    return pb.DecodeEvent(tokens=pb.Tokens(tokens=[pb.Token(token_id=i) for i in ids], finish_reason=finish))


def _relay(items: list[object]) -> list[object]:
    """What the Decode stream sends for these queued items (all queued before it reads)."""

    async def run() -> list[object]:
        queue: asyncio.Queue = asyncio.Queue()
        for item in items:
            queue.put_nowait(item)
        out = []
        async for item in coalesced(queue):
            out.append(item)
            if item is None or isinstance(item, BaseException):
                return out
        return out

    return asyncio.run(run())


def test_the_decode_stream_merges_tokens_already_queued_and_keeps_every_other_event_in_order() -> None:
    admitted = pb.DecodeEvent(admitted=pb.Admitted(dp_rank=0))
    out = _relay([_tokens(1), admitted, _tokens(2), _tokens(3, 4), _tokens(5, finish="length"), _tokens(6), None])
    assert out[0] == _tokens(1)  # an admitted event is not a token: it is not merged over
    assert out[1] == admitted
    assert out[2] == _tokens(2, 3, 4, 5, finish="length")  # ends at the finish reason
    assert out[3:] == [_tokens(6), None]
    boom = RuntimeError("kv lost")
    assert _relay([_tokens(1), _tokens(2), boom]) == [_tokens(1, 2), boom]


def test_the_decode_stream_sends_each_token_at_once_when_its_reader_keeps_up() -> None:
    async def run() -> list[pb.DecodeEvent]:
        queue: asyncio.Queue = asyncio.Queue()
        stream = coalesced(queue)
        got = []
        for i in range(3):
            queue.put_nowait(_tokens(i))
            got.append(await asyncio.wait_for(stream.__anext__(), 1.0))  # nothing waits for a second token
        return got

    assert asyncio.run(run()) == [_tokens(0), _tokens(1), _tokens(2)]
