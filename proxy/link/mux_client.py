"""The client half of the multiplexed calls: one ``PrefillMux`` / ``DecodeMux`` stream per node.

Every request's prefill call and decode stream go over its node's one stream (``pdcluster.v1``,
"Multiplexed calls") instead of an RPC each: a request costs the proxy a few protobuf messages
inside shared stream messages, not a call's setup, metadata and completion-queue round trips. A
writer task sends whatever calls and cancels are pending as one message; a reader task hands each
reply to its request. They look like the calls they replace: a failed call raises
``grpc.aio.AioRpcError`` with the node's status, a decode stream reads ``grpc.aio.EOF`` at its end.

A stream that breaks (the node died, its connection dropped) fails every call on it with the
stream's status, as each call would have failed on its own; the next call opens a new stream.

The server half is ``node_runtime.mux_server``. The messages' framing both speak is
``cluster.mux_wire``: the writer hands over ``Service.encode``'s bytes, each call serialized on its
own and framed as an element of the message's ``calls``, with no copy of the calls into one message.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

import grpc

from cluster.mux_wire import Service, status_code
from cluster.proto_gen import pdcluster_v1_pb2 as pb

log = logging.getLogger(__name__)

_TIMER_SLACK_S = 0.001  # a loop may run a timer up to its clock's resolution early


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _expire(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


async def _within(future: asyncio.Future[Any], timeout: float) -> Any:
    """``await future``, raising ``TimeoutError`` after ``timeout`` seconds (one timer: cheaper than
    ``asyncio.wait_for``; decode reads share their stream's timer instead, cheaper still)."""
    timer = future.get_loop().call_later(timeout, _expire, future)
    try:
        return await future
    finally:
        timer.cancel()


class _Waiter:
    """One call's end of a stream."""

    def deliver(self, reply: pb.MuxReply) -> bool:
        """Take a reply; True when it ends the call."""
        raise NotImplementedError

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        raise NotImplementedError


class MuxStream:
    """One multiplexed stream to one node over ``channel``: ``service`` is ``cluster.mux_wire``'s
    ``PREFILL`` or ``DECODE``; ``metadata`` goes with the stream's call."""

    def __init__(self, channel: grpc.aio.Channel, service: Service, metadata: Any = None) -> None:
        # The loop, once: on Python 3.11 every ``asyncio.get_running_loop()`` is a getpid() system call,
        # and the calls' futures are made per token (6% of the proxy's main thread, py-spy).
        self.loop = asyncio.get_running_loop()
        # No request serializer: the writer hands over the message's bytes (``Service.encode``).
        self._call = channel.stream_stream(service.method, response_deserializer=pb.MuxReplies.FromString)(
            metadata=metadata)
        self._service = service
        self._waiters: dict[str, _Waiter] = {}
        self._calls: list[Any] = []
        self._cancels: list[str] = []
        self._wake = asyncio.Event()
        self.broken = False
        self._writer = self.loop.create_task(self._write())
        self._reader = self.loop.create_task(self._read())
        # Decode reads waiting for their next event, each with its deadline (loop time). One timer, at
        # the earliest deadline, expires them, instead of a timer armed and cancelled for every token
        # read (2.3 us each under uvloop, ~6% of the proxy's loop at concurrency 128, py-spy). Reads of
        # one timeout come with later deadlines than those waiting: they leave the timer as it is.
        self.waiting: dict[DecodeCall, float] = {}
        self._expiry: asyncio.TimerHandle | None = None

    def watch(self, call: DecodeCall, timeout: float) -> None:
        """Expire ``call``'s wait ``timeout`` seconds from now (``DecodeCall.expire``)."""
        deadline = self.loop.time() + timeout
        self.waiting[call] = deadline
        if self._expiry is None or deadline < self._expiry.when():
            if self._expiry is not None:
                self._expiry.cancel()
            self._expiry = self.loop.call_at(deadline, self._expire_waits)

    def _expire_waits(self) -> None:
        self._expiry = None
        now = self.loop.time() + _TIMER_SLACK_S
        for call in [c for c, deadline in self.waiting.items() if deadline <= now]:
            del self.waiting[call]
            call.expire()
        if self.waiting:
            self._expiry = self.loop.call_at(min(self.waiting.values()), self._expire_waits)

    def _stop_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    def start(self, call: Any, waiter: _Waiter) -> None:
        rid = call.request_id
        if rid in self._waiters:  # the node would refuse it too; never reaches it
            waiter.fail(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid} is already in flight"))
            return
        self._waiters[rid] = waiter
        self._calls.append(call)
        self._wake.set()

    def cancel(self, request_id: str) -> None:
        if self._waiters.pop(request_id, None) is not None and not self.broken:
            unsent = [c for c in self._calls if c.request_id != request_id]
            if len(unsent) < len(self._calls):  # not written yet: it never reaches the node
                self._calls = unsent
                return
            # Written: the node cancels it. (A cancel in the same message as its call would reach the
            # node first, find nothing running, and the call would then run to its end.)
            self._cancels.append(request_id)
            self._wake.set()

    async def _write(self) -> None:
        while True:
            await self._wake.wait()
            # One turn of the event loop before writing: the calls of every request handled in it go in
            # the same message (on null nodes, 1.1-1.3x the request rate at concurrency 32-128).
            await asyncio.sleep(0)
            self._wake.clear()
            message = self._service.encode(self._calls, self._cancels)
            self._calls, self._cancels = [], []
            try:
                await self._call.write(message)
            except Exception:  # the call has failed: the reader gets its status and fails the waiters
                return

    async def _read(self) -> None:
        error = rpc_error(grpc.StatusCode.UNKNOWN, "the stream failed")
        try:
            while True:
                message = await self._call.read()
                if message is grpc.aio.EOF:
                    error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the node ended the stream")
                    break
                waiters = self._waiters
                for reply in message.replies:
                    waiter = waiters.get(reply.request_id)
                    if waiter is not None and waiter.deliver(reply):
                        del waiters[reply.request_id]
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the proxy closed the stream")
            raise
        finally:
            self.broken = True
            self._writer.cancel()
            self._stop_expiry()
            waiters, self._waiters = self._waiters, {}
            for waiter in waiters.values():
                waiter.fail(error)
        if error.code() != grpc.StatusCode.CANCELLED:
            log.warning("stream to a node broke (%s: %s); %d calls on it failed", error.code().name,
                        error.details(), len(waiters))

    def close(self) -> None:
        self._call.cancel()
        self._reader.cancel()
        self._stop_expiry()


class _PrefillWaiter(_Waiter):
    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future[pb.PrefillResponse]) -> None:
        self.future = future

    def deliver(self, reply: pb.MuxReply) -> bool:
        if not self.future.done():
            if reply.WhichOneof("reply") == "prefill":
                self.future.set_result(reply.prefill)
            else:
                self.future.set_exception(rpc_error(status_code(reply.status), reply.status.details))
        return True

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        if not self.future.done():
            self.future.set_exception(error)


async def prefill(stream: MuxStream, request: pb.PrefillRequest, timeout: float) -> pb.PrefillResponse:
    """``Prefill`` over the stream, with a deadline (DEADLINE_EXCEEDED past it, as the RPC's)."""
    future: asyncio.Future[pb.PrefillResponse] = stream.loop.create_future()
    stream.start(request, _PrefillWaiter(future))
    try:
        return await _within(future, timeout)
    except TimeoutError:
        stream.cancel(request.request_id)
        raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"no prefill answer in {timeout:g}s") from None
    except asyncio.CancelledError:
        stream.cancel(request.request_id)
        raise


class DecodeCall(_Waiter):
    """One ``Decode`` stream over the multiplexed stream: ``read`` as a streaming call's."""

    def __init__(self, stream: MuxStream, request: pb.DecodeRequest) -> None:
        self._stream = stream
        self._request_id = request.request_id
        self._events: collections.deque[Any] = collections.deque()
        self._error: grpc.aio.AioRpcError | None = None
        self._wake: asyncio.Future[None] | None = None
        self._ended = False
        stream.start(request, self)

    def deliver(self, reply: pb.MuxReply) -> bool:
        if reply.WhichOneof("reply") == "event":
            self._events.append(reply.event)
            ended = False
        else:
            code = status_code(reply.status)
            if code == grpc.StatusCode.OK:
                self._events.append(grpc.aio.EOF)
            else:
                self._error = rpc_error(code, reply.status.details)
            self._ended = ended = True
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)
        return ended

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        self._error = error
        self._ended = True
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    @property
    def ready(self) -> bool:
        """Whether ``read`` would answer without waiting."""
        return bool(self._events) or self._error is not None

    def expire(self) -> None:
        """The stream's timer: this read waited past its deadline."""
        if self._wake is not None and not self._wake.done():
            self._wake.set_exception(TimeoutError())

    async def read(self, timeout: float) -> Any:
        """The next event (``grpc.aio.EOF`` at the end); raises the call's ``AioRpcError``, or
        ``TimeoutError`` when nothing comes for ``timeout`` seconds."""
        if not self._events and self._error is None:
            stream = self._stream
            self._wake = stream.loop.create_future()
            stream.watch(self, timeout)
            try:
                await self._wake
            finally:
                self._wake = None
                stream.waiting.pop(self, None)
        if self._events:
            return self._events.popleft()
        assert self._error is not None
        raise self._error

    def cancel(self) -> None:
        """Cancel the stream (the node aborts the request); nothing more is read."""
        if not self._ended:
            self._ended = True
            self._stream.cancel(self._request_id)
