"""gRPC ``DecodeService`` over the decode worker (``pdcluster.v1``): a token stream per request."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from cluster.proto_gen import pdcluster_v1_pb2 as pb
from cluster.proto_gen import pdcluster_v1_pb2_grpc as pb_grpc
from cluster.wire import sampling_from_pb, top_from_pb
from decode_node.replica import Job, NodeStopping
from decode_node.worker import DecodeWorker
from kv_transfer.handle import from_handle
from kv_transfer.handoff import KVLost
from kv_transfer.transport import TransferError
from node_runtime.metrics import NodeMetrics
from node_runtime.mux_server import CallContext, DecodeMux, Send
from node_runtime.server import Lifecycle

log = logging.getLogger("pdcluster.decode")


def _open_tokens(item: object) -> bool:
    return isinstance(item, pb.DecodeEvent) and item.WhichOneof("event") == "tokens" and not item.tokens.finish_reason


async def coalesced(events: asyncio.Queue) -> AsyncIterator[object]:
    """The queue's items in order, with ``tokens`` events that are already queued merged into one.

    When the stream's reader keeps up, each event goes out alone as soon as it is queued; when it is
    behind (the previous write is still waiting), the tokens made meanwhile leave as one message
    instead of one message each. Nothing waits for more tokens: a token is never held back.
    """
    held: object = None
    has_held = False
    while True:
        item = held if has_held else await events.get()
        has_held = False
        if _open_tokens(item):
            assert isinstance(item, pb.DecodeEvent)
            while not events.empty():
                nxt = events.get_nowait()
                if not (isinstance(nxt, pb.DecodeEvent) and nxt.WhichOneof("event") == "tokens"):
                    held, has_held = nxt, True
                    break
                item.tokens.tokens.extend(nxt.tokens.tokens)
                if nxt.tokens.finish_reason:
                    item.tokens.finish_reason = nxt.tokens.finish_reason
                    break
        yield item


def call_sink(send: Send) -> tuple[Callable[[object], None], asyncio.Future]:
    """A multiplexed call's sink: its events go to ``send``, its end (None) or failure (an exception)
    into the future the call's handler waits on."""
    done: asyncio.Future = asyncio.get_running_loop().create_future()

    def sink(item: object) -> None:
        if isinstance(item, pb.DecodeEvent):
            send(item)
        elif not done.done():
            done.set_result(item)

    return sink, done


class DecodeService(DecodeMux, pb_grpc.DecodeServiceServicer):
    def __init__(self, worker: DecodeWorker, node_id: str, state: Lifecycle, metrics: NodeMetrics) -> None:
        self.worker = worker
        self.node_id = node_id
        self.state = state
        self.metrics = metrics
        self.vocab_size = worker.vocab_size
        self.block_size = worker.config.engine.block_size

    async def Decode(
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeEvent]:
        events: asyncio.Queue = asyncio.Queue()
        await self._submit(request, context, events.put_nowait)
        finished = False
        try:
            async for item in coalesced(events):
                if item is None:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    await context.abort(*_status(item))
                assert isinstance(item, pb.DecodeEvent)
                yield item
        finally:
            if not finished:  # the client went away (or the stream broke): free the request here
                self.worker.abort(request.request_id)

    async def decode_into(self, request: pb.DecodeRequest, context: CallContext, send: Send) -> None:
        """``Decode`` for a multiplexed call (``node_runtime.mux_server``): each event goes to ``send`` from the
        callback that delivers an engine step's events (``decode_node.outbox``), and this task wakes
        only at the end: no task switch per stream and step."""
        sink, done = call_sink(send)
        await self._submit(request, context, sink)
        finished = False
        try:
            end = await done
            finished = True
            if end is not None:
                await context.abort(*_status(end))
        finally:
            if not finished:  # the call was cancelled (the proxy's cancel, or the stream broke)
                self.worker.abort(request.request_id)

    async def _submit(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext | CallContext,
                      sink: Callable[[object], None]) -> None:
        """Check the request (``context.abort`` with INVALID_ARGUMENT, or UNAVAILABLE while stopping) and
        hand it to the worker; its events go to ``sink``, on this event loop's thread."""
        rid = request.request_id
        if not rid or not request.prompt_token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id and prompt_token_ids are required")
        if not -1 <= request.dp_rank < len(self.worker.replicas):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"dp_rank {request.dp_rank} outside [-1, {len(self.worker.replicas)})")
        if self.state.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the node is stopping")
        local = request.WhichOneof("kv_source") == "local_prefill"  # prefilled here, no KV to pull
        source = None
        try:
            params = sampling_from_pb(request.sampling)
            if not local:
                source = from_handle(request.kv, self.worker.kv_cache_dtype)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if source is not None:
            if source.block_size != self.block_size:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"block size {source.block_size} differs from this node's {self.block_size}")
            want_blocks = -(-len(request.prompt_token_ids) // self.block_size)
            if source.request.num_blocks != want_blocks:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the KV handle has "
                                    f"{source.request.num_blocks} blocks, the prompt needs {want_blocks}")
            if not 0 <= request.first_token.token_id < self.vocab_size:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"first token {request.first_token.token_id} outside the vocabulary")
            if any(not 0 <= t < self.vocab_size for t in request.mtp_drafts):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "an MTP draft token is outside the vocabulary")
        elif any(not 0 <= t < self.vocab_size for t in request.prompt_token_ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt token ids outside the vocabulary")
        first = request.first_token
        job = Job(rid, list(request.prompt_token_ids), params, source, first.token_id, first.logprob,
                  top_from_pb(first), tuple(request.mtp_drafts))
        sink = self.metrics.decode_call(len(request.prompt_token_ids), sink)
        self.worker.submit(job, request.dp_rank, asyncio.get_running_loop(), sink)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        found = self.worker.has(request.request_id)
        self.worker.abort(request.request_id)
        return pb.AbortResponse(found=found)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        reps, totals = self.worker.stats_pb()
        return pb.StatsResponse(node_id=self.node_id, role="decode", replicas=reps, transfers=totals)


def _status(e: BaseException) -> tuple[grpc.StatusCode, str]:
    # A failed pull is the prefill side's problem (or the link's), not this node's: not UNAVAILABLE,
    # which would make the proxy mark this node unreachable.
    if isinstance(e, (TransferError, KVLost)):
        return grpc.StatusCode.FAILED_PRECONDITION, f"KV transfer failed: {e}"
    if isinstance(e, NodeStopping):
        return grpc.StatusCode.UNAVAILABLE, str(e)
    if isinstance(e, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
    if isinstance(e, (ValueError, TypeError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    return grpc.StatusCode.ABORTED, str(e)
