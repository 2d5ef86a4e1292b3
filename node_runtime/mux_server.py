"""The server half of the multiplexed calls: ``PrefillMux`` and ``DecodeMux`` over a servicer's own handlers.

The proxy keeps one stream per node and sends every request's ``Prefill`` or ``Decode`` over it
(``pdcluster.v1``, "Multiplexed calls"; the client half is ``proxy.link.mux_client``, the messages'
format both speak ``cluster.mux_wire``). Here each call on the stream runs the servicer's ordinary
handler, as its own task, with a context whose ``abort`` ends that call alone: the same checks,
status codes and events as the call on its own, with no RPC per request. What the handlers produce
goes into one queue; the stream writes whatever is queued as one message (the tokens of a request
that are queued together merge into one event), so under load a write carries many requests.

A servicer says which handler its calls run by its mixin (put it first among the bases), each a
``Form`` of handler: ``PrefillMux`` runs ``Prefill`` (``UNARY``: it returns the reply);
``DecodeEventsMux`` runs ``Decode`` (``EVENTS``: an async generator of the call's events);
``DecodeMux`` runs ``decode_into(call, context, send)`` (``SINK``): the call's events go to ``send``
from whatever delivers them (the callback that hands over an engine step's events), straight onto the
stream's queue, and the handler's task wakes only at the call's end. Relaying each event through the
handler's async generator costs a task switch per stream and engine step.

A cancel message, the client ending the stream or the stream breaking cancels the calls concerned,
exactly as cancelling each call would (the handlers free what the request holds).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc

from cluster.mux_wire import Reply, replies_message, status_reply
from cluster.proto_gen import pdcluster_v1_pb2 as pb

log = logging.getLogger("pdcluster.mux")

MAX_REPLIES = 256  # replies per message: bounds a message (a prefill reply's KV handle can be large)
# Turns of the event loop between the first reply queued and the write: through handlers that relay
# (``Form.EVENTS``), an engine step's tokens reach the handlers in one turn and are queued in the next,
# so the step's tokens of every stream go in one message rather than in several (docs/benchmarks.md:
# fewer, larger messages cost both ends less CPU per request). Through sinks (``Form.SINK``) a step's
# events are queued at once; the turns still gather the replies of calls that end or answer meanwhile.
# Kept at 2 for both: the sink path was measured with it (docs/benchmarks.md, 2026-12-03).
WRITE_AFTER_TURNS = 2


class CallAborted(Exception):
    """A handler aborted its call (``context.abort``): the call's status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class CallContext:
    """What a handler may use of its context inside a multiplexed call: ``abort`` ends this call only."""

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> NoReturn:
        raise CallAborted(code, details)


Send = Callable[[Any], None]  # one decode event of the call, onto the stream's queue


class Form(enum.Enum):
    """How a handler gives its call's replies."""

    UNARY = enum.auto()  # ``handler(call, context)`` returns the reply (``Prefill``)
    EVENTS = enum.auto()  # ``handler(call, context)`` is an async generator of the call's events (``Decode``)
    SINK = enum.auto()  # ``handler(call, context, send)`` sends the events, returns at the call's end


async def serve(calls: AsyncIterator[Any], handler: Callable[..., Any], form: Form) -> AsyncIterator[pb.MuxReplies]:
    """Run each call of the ``calls`` stream through ``handler``, a handler of that ``form``; yield their
    replies, batched."""
    out: asyncio.Queue[Reply | None] = asyncio.Queue()
    running: dict[str, asyncio.Task[None]] = {}
    context = CallContext()

    async def one(call: Any) -> None:
        rid = call.request_id
        try:
            if form is Form.SINK:
                live = True  # events sent after the call ended (cancelled) are not written

                def send(event: Any) -> None:
                    if live:
                        out.put_nowait((rid, "event", event))

                try:
                    await handler(call, context, send)
                finally:
                    live = False
                out.put_nowait(status_reply(rid, grpc.StatusCode.OK, ""))
            elif form is Form.EVENTS:
                async for event in handler(call, context):
                    out.put_nowait((rid, "event", event))
                out.put_nowait(status_reply(rid, grpc.StatusCode.OK, ""))
            else:
                reply = await handler(call, context)
                out.put_nowait((rid, "prefill", reply))
        except CallAborted as e:
            out.put_nowait(status_reply(rid, e.code, e.details))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a handler's bug: this call fails as it would on its own, the others go on
            log.exception("call %s failed", rid)
            out.put_nowait(status_reply(rid, grpc.StatusCode.UNKNOWN, f"{type(e).__name__}: {e}"))
        finally:
            if running.get(rid) is asyncio.current_task():
                del running[rid]

    async def read() -> None:
        async for message in calls:
            for rid in message.cancel:
                task = running.pop(rid, None)
                if task is not None:
                    task.cancel()
            for call in message.calls:
                if call.request_id in running:
                    out.put_nowait(status_reply(call.request_id, grpc.StatusCode.INVALID_ARGUMENT,
                                                f"request {call.request_id} is already in flight on this stream"))
                    continue
                running[call.request_id] = asyncio.ensure_future(one(call))
        while running:  # the client is done sending: finish what runs, then end the stream
            await asyncio.wait(list(running.values()))
        out.put_nowait(None)

    reader = asyncio.ensure_future(read())
    reader.add_done_callback(lambda t: None if t.cancelled() or t.exception() is None else out.put_nowait(None))
    try:
        while True:
            first = await out.get()
            end = first is None
            replies: list[Reply] = [] if first is None else [first]
            if not end:
                for _ in range(WRITE_AFTER_TURNS):
                    await asyncio.sleep(0)
            # Up to the end mark, never past it: replies queued behind it (handlers still running when
            # the reader failed) must not hide it.
            while not end and not out.empty() and len(replies) < MAX_REPLIES:
                item = out.get_nowait()
                if item is None:
                    end = True
                else:
                    replies.append(item)
            if replies:
                yield replies_message(replies)
            if end:
                if not reader.cancelled() and reader.done() and reader.exception() is not None:
                    raise reader.exception()  # type: ignore[misc]
                return
    finally:
        reader.cancel()
        for task in list(running.values()):
            task.cancel()


class PrefillMux:
    """``PrefillMux`` for a ``PrefillService`` servicer (put it first among the bases): through its
    ``Prefill``."""

    Prefill: Callable[[Any, Any], Awaitable[pb.PrefillResponse]]

    async def PrefillMux(self, request_iterator: AsyncIterator[pb.PrefillCalls],  # noqa: N802
                         context: grpc.aio.ServicerContext) -> AsyncIterator[pb.MuxReplies]:
        async for replies in serve(request_iterator, self.Prefill, Form.UNARY):
            yield replies


class DecodeMux:
    """``DecodeMux`` for a ``DecodeService`` servicer (put it first among the bases): through its
    ``decode_into``, which sends each call's events onto the stream's queue as they are delivered."""

    decode_into: Callable[[Any, CallContext, Send], Awaitable[None]]

    async def DecodeMux(self, request_iterator: AsyncIterator[pb.DecodeCalls],  # noqa: N802
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.MuxReplies]:
        async for replies in serve(request_iterator, self.decode_into, Form.SINK):
            yield replies


class DecodeEventsMux:
    """``DecodeMux`` for a ``DecodeService`` servicer without a ``decode_into`` (put it first among the
    bases): through its ``Decode``, each call's events relayed from the handler's async generator."""

    Decode: Callable[[Any, Any], AsyncIterator[pb.DecodeEvent]]

    async def DecodeMux(self, request_iterator: AsyncIterator[pb.DecodeCalls],  # noqa: N802
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.MuxReplies]:
        async for replies in serve(request_iterator, self.Decode, Form.EVENTS):
            yield replies
