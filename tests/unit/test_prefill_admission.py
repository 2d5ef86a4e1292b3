"""A prefill node refuses requests beyond ``max_queued_prefills`` with RESOURCE_EXHAUSTED (the proxy then
tries another replica, or answers 503 with Retry-After), and queues them below it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from cluster.proto_gen import pdcluster_v1_pb2 as pb
from node_runtime.metrics import NodeMetrics
from node_runtime.server import Lifecycle
from prefill_node.service import PrefillService


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


class Worker:
    def __init__(self, queued: int, bound: int) -> None:
        self.jobs = {f"r{i}": None for i in range(queued)}
        self.engines = [None]
        self.config = SimpleNamespace(max_queued_prefills=bound)
        self.submitted: list = []

    def submit(self, job) -> None:  # noqa: ANN001
        self.submitted.append(job)
        job.future.set_result(pb.PrefillResponse(request_id=job.request_id))


def call(worker: Worker) -> pb.PrefillResponse:
    service = PrefillService(worker, "p0", Lifecycle(), NodeMetrics("m", "prefill", "p0"))  # type: ignore[arg-type]
    request = pb.PrefillRequest(request_id="new", token_ids=[1, 2, 3], sampling=pb.SamplingParams(max_tokens=4),
                                dp_rank=-1)
    return asyncio.run(service.Prefill(request, Context()))  # type: ignore[arg-type]


def test_a_full_queue_answers_resource_exhausted() -> None:
    worker = Worker(queued=3, bound=3)
    with pytest.raises(Aborted) as e:
        call(worker)
    assert e.value.args[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queued_prefills 3" in e.value.args[1]
    assert worker.submitted == []


def test_below_the_bound_requests_queue() -> None:
    worker = Worker(queued=2, bound=3)
    assert call(worker).request_id == "new" and len(worker.submitted) == 1
