"""A node's ``/metrics`` (``node_runtime.metrics``): the request-level series its services observe, in vLLM's
names, and the state series read from its worker, served over HTTP as Prometheus scrapes them."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.nodes import NodeInfo, ReplicaLoad
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from node_runtime import metrics as node_metrics
from node_runtime.metrics import NodeMetrics

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
NODE = (("model_name", "tiny"), ("node", "decode-0"))


def scrape(url: str) -> Samples:
    page = httpx.get(url, timeout=10)
    page.raise_for_status()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(page.text) for s in family.samples}


def labels(role: str = "decode", replica: str | None = None, **more: str) -> tuple[tuple[str, str], ...]:
    out = dict(NODE, role=role, **more)
    if replica is not None:
        out["replica"] = replica
    return tuple(sorted(out.items()))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Worker:
    loads: list[ReplicaLoad]
    totals: pb.TransferTotals = field(default_factory=pb.TransferTotals)
    kv_protocol: str = "tcp"

    def load(self) -> list[ReplicaLoad]:
        return self.loads

    def transfer_totals(self) -> pb.TransferTotals:
        return self.totals


def info(role: str = "decode") -> NodeInfo:
    return NodeInfo(node_id="decode-0", role=role, address="127.0.0.1:1", model="tiny", max_model_len=1024, dp=2,
                    pcp=1, pp=1, kv_layout="replicated", block_size=16, num_blocks=64, started_at=0.0, ep=2,
                    experts_per_rank=4, kv_cache_dtype="bf16", weights="bfloat16")


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(node_metrics.time, "monotonic", c)
    return c


def test_a_decode_calls_times_and_tokens_in_vllms_names(clock: Clock) -> None:
    m = NodeMetrics("tiny", "decode", "decode-0")
    seen: list[object] = []
    sink = m.decode_call(40, seen.append)
    clock.now += 0.5  # the KV pull
    sink(pb.DecodeEvent(admitted=pb.Admitted(dp_rank=1, cached_tokens=16)))
    clock.now += 0.1
    sink(pb.DecodeEvent(tokens=pb.Tokens(tokens=[pb.Token(token_id=5)])))  # the first token made here
    clock.now += 0.03
    sink(pb.DecodeEvent(tokens=pb.Tokens(tokens=[pb.Token(token_id=6), pb.Token(token_id=7)])))  # 2 at once
    clock.now += 0.004
    sink(pb.DecodeEvent(tokens=pb.Tokens(tokens=[pb.Token(token_id=8)], finish_reason="length")))
    sink(None)
    assert len(seen) == 5 and seen[-1] is None  # every item reaches the call's own sink
    failed = m.decode_call(8, seen.append)  # refused before admission: no request-level series move
    failed(ValueError("bad handle"))
    port = m.start("127.0.0.1", 0)
    try:
        m.watch(Worker([ReplicaLoad(dp_rank=0), ReplicaLoad(dp_rank=1)]), info())
        s = scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        m.stop()
    r1 = labels(replica="1")
    assert s[("vllm:request_queue_time_seconds_sum", r1)] == pytest.approx(0.5)
    assert s[("vllm:time_to_first_token_seconds_sum", r1)] == pytest.approx(0.6)
    assert s[("vllm:time_to_first_token_seconds_count", r1)] == 1
    assert s[("vllm:inter_token_latency_seconds_count", r1)] == 3  # 2 tokens sharing 30 ms, then 1 after 4 ms
    assert s[("vllm:inter_token_latency_seconds_sum", r1)] == pytest.approx(0.034)
    assert s[("vllm:inter_token_latency_seconds_bucket", tuple(sorted((*r1, ("le", "0.005")))))] == 1
    assert s[("vllm:inter_token_latency_seconds_bucket", tuple(sorted((*r1, ("le", "0.025")))))] == 3
    assert s[("vllm:e2e_request_latency_seconds_sum", r1)] == pytest.approx(0.634)
    assert s[("vllm:generation_tokens_total", r1)] == 4
    assert s[("vllm:prompt_tokens_total", r1)] == 40
    assert s[("vllm:prefix_cache_queries_total", r1)] == 40
    assert s[("vllm:prefix_cache_hits_total", r1)] == 16
    assert not any(name.startswith("vllm:") and dict(lbl).get("replica") == "0" and name.endswith("_count")
                   and v for (name, lbl), v in s.items())


def test_a_prefill_answer_counts_its_prompt_cache_hits_and_one_token(clock: Clock) -> None:
    m = NodeMetrics("tiny", "prefill", "decode-0")
    arrival = clock.now
    clock.now += 0.25
    m.prefilled(arrival, 100, pb.PrefillResponse(dp_rank=0, cached_tokens=64), queue_s=0.05)
    m.prefilled(clock.now, 10, pb.PrefillResponse(dp_rank=0), queue_s=None)  # vLLM's wait is not known
    m.flush()
    s = {(x.name, tuple(sorted(x.labels.items()))): x.value for f in m.registry.collect() for x in f.samples}
    r0 = labels("prefill", "0")
    assert s[("vllm:time_to_first_token_seconds_sum", r0)] == pytest.approx(0.25)
    assert s[("vllm:e2e_request_latency_seconds_count", r0)] == 2
    assert s[("vllm:request_queue_time_seconds_count", r0)] == 1
    assert s[("vllm:prompt_tokens_total", r0)] == 110
    assert s[("vllm:generation_tokens_total", r0)] == 2
    assert s[("vllm:prefix_cache_hits_total", r0)] == 64


def test_the_state_series_read_the_worker_at_each_page() -> None:
    m = NodeMetrics("tiny", "decode", "decode-0")
    worker = Worker([ReplicaLoad(dp_rank=0, running=3, waiting=1, used_blocks=16, free_blocks=48, preemptions=2,
                                 spec_drafts=3, spec_draft_tokens=6, spec_accepted_tokens=4),
                     ReplicaLoad(dp_rank=1)],
                    pb.TransferTotals(done=7, bytes=4096, seconds=0.5, failures={"timeout": 1}))
    port = m.start("127.0.0.1", 0)
    try:
        m.watch(worker, info())
        url = f"http://127.0.0.1:{port}/metrics"
        s = scrape(url)
        assert s[("vllm:num_requests_running", labels(replica="0"))] == 3
        assert s[("vllm:num_requests_waiting", labels(replica="0"))] == 1
        assert s[("vllm:kv_cache_usage_perc", labels(replica="0"))] == 0.25
        assert s[("vllm:num_preemptions_total", labels(replica="0"))] == 2
        assert ("vllm:num_preemptions_total", labels(replica="1")) not in s  # not known (None): not shown
        assert s[("vllm:spec_decode_num_drafts_total", labels(replica="0"))] == 3
        assert s[("vllm:spec_decode_num_draft_tokens_total", labels(replica="0"))] == 6
        assert s[("vllm:spec_decode_num_accepted_tokens_total", labels(replica="0"))] == 4
        assert ("vllm:spec_decode_num_drafts_total", labels(replica="1")) not in s  # off there
        assert s[("pdcluster_kv_transfers_total", labels(protocol="tcp"))] == 7
        assert s[("pdcluster_kv_transfer_bytes_total", labels(protocol="tcp"))] == 4096
        assert s[("pdcluster_kv_transfer_failures_total", labels(protocol="tcp", cause="timeout"))] == 1
        assert s[("pdcluster_experts_per_rank", labels())] == 4
        assert s[("pdcluster_node_info", labels(engine="native", dp="2", pcp="1", pp="1", ep="2",
                                                 kv_layout="replicated", kv_cache_dtype="bf16",
                                                 kv_protocol="tcp", weights="bfloat16"))] == 1
        assert s[("process_resident_memory_bytes", ())] > 0
        worker.loads = [ReplicaLoad(dp_rank=0, used_blocks=0, free_blocks=64), ReplicaLoad(dp_rank=1)]
        s = scrape(url)
        assert s[("vllm:num_requests_running", labels(replica="0"))] == 0
        assert s[("vllm:kv_cache_usage_perc", labels(replica="0"))] == 0
    finally:
        m.stop()


def test_a_taken_port_is_a_clear_error() -> None:
    first = NodeMetrics("tiny", "decode", "decode-0")
    port = first.start("127.0.0.1", 0)
    try:
        with pytest.raises(RuntimeError, match="--metrics-port"):
            NodeMetrics("tiny", "decode", "decode-1").start("127.0.0.1", port)
    finally:
        first.stop()


def test_pdctl_status_says_how_many_drafts_a_node_accepts() -> None:
    from pdctl.cli import _spec_text

    assert _spec_text([ReplicaLoad(dp_rank=0)]) == ""  # off
    assert _spec_text([ReplicaLoad(dp_rank=0, spec_drafts=0, spec_draft_tokens=0, spec_accepted_tokens=0)]) \
        == "\nMTP on"
    both = [ReplicaLoad(dp_rank=0, spec_drafts=10, spec_draft_tokens=20, spec_accepted_tokens=14),
            ReplicaLoad(dp_rank=1, spec_drafts=10, spec_draft_tokens=20, spec_accepted_tokens=16)]
    assert _spec_text(both) == "\nMTP: 75% accepted, 2.5 tok/step"
