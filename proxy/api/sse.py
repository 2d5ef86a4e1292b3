"""Client disconnects: a streaming response that notices them, and a guard for non-streaming work.

Starlette notices a disconnect only while it sends (or, depending on the ASGI spec version,
not at all while the body iterator waits): a stalled decode stream would keep a request alive
for nobody. Here one listener per request (``ClientWatch``) waits on ``receive()`` beside the work and
cancels it the moment the client goes; cleanup (``on_close``) runs however the response ends, even if
it never started.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


DONE = b"data: [DONE]\n\n"  # OpenAI's last event: the stream ends with it, the generator is not read on


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


_SCOPE_KEY = "pdcluster.client_watch"


class ClientWatch:
    """One request's connection, watched for the client's leaving by one task for the request's whole
    life: through its wait for the nodes and through its streamed answer.

    ``guard(work)`` runs ``work`` in the calling task and cancels it there when the client leaves. A
    watcher task per phase, and a task per guarded piece of work, had cost ~0.2 ms of the time to the
    first token at concurrency 1 (docs/benchmarks.md). Whoever ends the request calls ``close``.
    """

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._loop = asyncio.get_running_loop()  # once: each lookup is a getpid() call on Python 3.11
        self._task: asyncio.Task[None] | None = None
        self._guarded: asyncio.Task[Any] | None = None
        self._cancelled_guarded = False
        self._closed = False
        self.gone = False

    @classmethod
    def of(cls, request: Request) -> ClientWatch:
        """The request's watch (made at its first use). The request body must already be read: from
        then on ``receive()`` only reports the disconnect."""
        watch = request.scope.get(_SCOPE_KEY)
        if watch is None:
            watch = request.scope[_SCOPE_KEY] = cls(request.receive)
        return watch

    async def guard(self, work: Coroutine[Any, Any, T]) -> T:
        """``await work``; cancelled (its cleanup runs) and ``ClientDisconnected`` raised if the client
        leaves first."""
        assert not self._closed, "the request's watch is closed: the request has ended"
        if self._task is None:
            self._task = self._loop.create_task(_wait_disconnect(self._receive))
            self._task.add_done_callback(self._ended)
        if self.gone:
            work.close()
            raise ClientDisconnected()
        me = asyncio.current_task(self._loop)
        assert me is not None and self._guarded is None, "one guarded piece of work at a time"
        self._guarded, self._cancelled_guarded = me, False
        try:
            return await work
        except asyncio.CancelledError:
            # Ours (the client left), unless someone else cancelled too: then theirs goes on.
            if self._cancelled_guarded:
                self._cancelled_guarded = False
                if me.uncancel() == 0:
                    raise ClientDisconnected() from None
            raise
        finally:
            self._guarded = None
            if self._cancelled_guarded:  # the work swallowed our cancel: take it back all the same
                self._cancelled_guarded = False
                me.uncancel()

    def _ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        task.exception()  # retrieved: receive() failing means the connection is gone as well
        self.gone = True
        if self._guarded is not None and not self._guarded.done():
            self._cancelled_guarded = True
            self._guarded.cancel()

    def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()


async def until_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Run ``work``; cancel it and raise ``ClientDisconnected`` if the client leaves first
    (``ClientWatch.guard`` with the request's watch)."""
    return await ClientWatch.of(request).guard(work)


class EventStreamResponse(StreamingResponse):
    """``text/event-stream`` from an async iterator of SSE frames (bytes), cancelled on client disconnect
    (``watch``: the request's, which it closes).

    ``on_close(disconnected)`` runs exactly once, however the response ends.
    """

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[bool], None],
                 watch: ClientWatch) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close
        self._watch = watch

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished = False  # else the client left, the server is stopping, or the send failed
        try:
            await self._watch.guard(self._produce(send))
            finished = True
        except (ClientDisconnected, OSError):  # OSError: the client went away mid-send
            pass
        except Exception:  # our failure, not the client's leaving: it ends the response, and is raised
            finished = True
            raise
        finally:
            self._watch.close()
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()
            self._on_close(not finished)

    def mapped(self, fn: Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]]) -> EventStreamResponse:
        """This response with its frames turned into others by ``fn`` (which closes the frames it reads)."""
        return EventStreamResponse(fn(self._events), self._on_close, self._watch)

    async def _produce(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for event in self._events:
            last = event.endswith(DONE)  # the body's end goes with the last event: one send less
            await send({"type": "http.response.body", "body": event, "more_body": not last})
            if last:
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
