"""gRPC ``PrefillService`` over the prefill worker (``pdcluster.v1``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from cluster.proto_gen import pdcluster_v1_pb2 as pb
from cluster.proto_gen import pdcluster_v1_pb2_grpc as pb_grpc
from cluster.wire import sampling_from_pb
from node_runtime.metrics import NodeMetrics
from node_runtime.mux_server import PrefillMux
from node_runtime.server import Lifecycle
from prefill_node.worker import Aborted, NodeFailed, PrefillJob, PrefillWorker

log = logging.getLogger("pdcluster.prefill")


class PrefillService(PrefillMux, pb_grpc.PrefillServiceServicer):
    def __init__(self, worker: PrefillWorker, node_id: str, state: Lifecycle, metrics: NodeMetrics) -> None:
        self.worker = worker
        self.node_id = node_id
        self.state = state
        self.metrics = metrics

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        if not request.token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "token_ids is empty")
        if not -1 <= request.dp_rank < len(self.worker.engines):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"dp_rank {request.dp_rank} outside [-1, {len(self.worker.engines)})")
        if self.state.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the node is stopping")
        queued, bound = len(self.worker.jobs), self.worker.config.max_queued_prefills  # waiting or prefilling
        if queued >= bound:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{queued} requests queued (max_queued_prefills {bound})")
        try:
            params = sampling_from_pb(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        arrival = time.monotonic()
        loop = asyncio.get_running_loop()
        job = PrefillJob(request.request_id, list(request.token_ids), params, request.dp_rank, loop,
                         loop.create_future())
        self.worker.submit(job)
        try:
            reply = await job.future
        except asyncio.CancelledError:  # the proxy went away: nothing may stay held for it
            self.worker.abort(request.request_id)
            raise
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Aborted:
            await context.abort(grpc.StatusCode.ABORTED, f"request {request.request_id} was aborted")
        except NodeFailed as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        self.metrics.prefilled(arrival, len(request.token_ids), reply, reply.queue_s)
        return reply

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(found=await self._on_engine(self.worker.release, request.request_id))

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(found=await self._on_engine(self.worker.abort, request.request_id))

    async def _on_engine(self, call: Callable[[str, Callable[[bool], None]], None], request_id: str) -> bool:
        """Run a release/abort through the worker and wait for its answer (an abort's once the blocks are
        free; a release's at once)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        def done(found: bool) -> None:
            loop.call_soon_threadsafe(lambda: None if fut.done() else fut.set_result(found))

        call(request_id, done)
        return await asyncio.wait_for(fut, timeout=10)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        reps, totals = self.worker.stats()
        return pb.StatsResponse(node_id=self.node_id, role="prefill", replicas=reps, transfers=totals)
