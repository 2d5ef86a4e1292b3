"""gRPC ``DecodeService`` over the decode worker (``pdcluster.v1``): a token stream per request."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from cluster.node_runtime import GRPC_OPTIONS, NodeState
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from cluster.proto_gen import pdcluster_v1_pb2_grpc as pb_grpc
from cluster.wire import sampling_from_pb
from decode_node.worker import DecodeJob, DecodeWorker
from kv_transfer.handle import from_handle
from kv_transfer.transport import TransferError

log = logging.getLogger("pdcluster.decode")
CONFIRM_TIMEOUT_S = 5.0


class DecodeService(pb_grpc.DecodeServiceServicer):
    def __init__(self, worker: DecodeWorker, node_id: str, state: NodeState) -> None:
        self.worker = worker
        self.node_id = node_id
        self.state = state
        self._prefill: dict[str, pb_grpc.PrefillServiceStub] = {}
        self._tasks: set[asyncio.Task] = set()

    def _prefill_stub(self, address: str) -> pb_grpc.PrefillServiceStub:
        stub = self._prefill.get(address)
        if stub is None:
            stub = pb_grpc.PrefillServiceStub(grpc.aio.insecure_channel(address, options=GRPC_OPTIONS))
            self._prefill[address] = stub
        return stub

    async def _confirm(self, address: str, request_id: str) -> None:
        """Tell the prefill node it may free the request's KV (else its lease frees it later)."""
        try:
            await self._prefill_stub(address).Release(pb.ReleaseRequest(request_id=request_id),
                                                      timeout=CONFIRM_TIMEOUT_S)
        except grpc.RpcError as e:
            log.warning("could not confirm %s to %s: %s", request_id, address, e)

    async def Decode(
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeEvent]:
        rid = request.request_id
        if not rid or not request.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id and prompt_token_ids are required")
        if not -1 <= request.dp_rank < len(self.worker.replicas):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"dp_rank {request.dp_rank} outside [-1, {len(self.worker.replicas)})")
        if self.state.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the node is stopping")
        try:
            params = sampling_from_pb(request.sampling)
            source = from_handle(request.kv)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if source.block_size != self.worker.config.engine.block_size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"block size {source.block_size} differs from this node's "
                                f"{self.worker.config.engine.block_size}")
        loop = asyncio.get_running_loop()
        job = DecodeJob(rid, list(request.prompt_token_ids), params, request.first_token, source, loop,
                        asyncio.Queue())
        self.worker.submit(job, request.dp_rank)
        finished = False
        try:
            while True:
                item = await job.events.get()
                if item is None:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    await context.abort(*_status(item))
                if item.HasField("admitted"):
                    task = asyncio.create_task(self._confirm(source.prefill_address, rid))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                yield item
        finally:
            if not finished:  # the client went away (or the stream broke): free the request here
                self.worker.abort(rid)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        self.worker.abort(request.request_id)
        return pb.AbortResponse(found=True)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        return self.state.health(self.node_id, "decode")

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        reps, totals = self.worker.stats_pb()
        return pb.StatsResponse(node_id=self.node_id, role="decode", replicas=reps, transfers=totals)


def _status(e: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(e, TransferError):
        return grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {e}"
    if isinstance(e, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
    if isinstance(e, (ValueError, TypeError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    return grpc.StatusCode.ABORTED, str(e)
