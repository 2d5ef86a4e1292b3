"""Client disconnects: a streaming response that notices them, and a guard for non-streaming work.

Starlette notices a disconnect only while it sends (or, depending on the ASGI spec version,
not at all while the body iterator waits): a stalled decode stream would keep a request alive
for nobody. Here a listener waits on ``receive()`` beside the work and cancels it the moment the
client goes; cleanup (``on_close``) runs however the response ends, even if it never started.
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


async def until_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Run ``work``; cancel it and raise ``ClientDisconnected`` if the client leaves first.

    The request body must already be read: from then on ``receive()`` only reports the disconnect.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # let its cleanup run before we return
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


class EventStreamResponse(StreamingResponse):
    """``text/event-stream`` from an async iterator of SSE frames (bytes), cancelled on client disconnect.

    ``on_close(disconnected)`` runs exactly once, however the response ends.
    """

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[bool], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        producer = asyncio.ensure_future(self._produce(send))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            finished = producer.done()  # else the client left (or the server is stopping)
            for t in (producer, watcher):
                t.cancel()
            await asyncio.gather(producer, watcher, return_exceptions=True)
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()
            self._on_close(not finished)
        error = producer.exception() if producer.done() and not producer.cancelled() else None
        if error is not None and not isinstance(error, OSError):  # OSError: the client went away mid-send
            raise error

    async def _produce(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for event in self._events:
            last = event.endswith(DONE)  # the body's end goes with the last event: one send less
            await send({"type": "http.response.body", "body": event, "more_body": not last})
            if last:
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
