"""proxy.sse.ClientWatch: one watcher per request cancels the guarded work when the client leaves,
and only then answers ClientDisconnected."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from proxy.api.sse import ClientDisconnected, ClientWatch, EventStreamResponse


class Connection:
    """An ASGI receive(): the body, then whatever ``leave()`` says."""

    def __init__(self) -> None:
        self.left = asyncio.Event()
        self.calls = 0

    async def receive(self) -> dict:
        self.calls += 1
        if self.calls == 1:
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await self.left.wait()
        return {"type": "http.disconnect"}


async def watched() -> tuple[Connection, ClientWatch]:
    """A connection whose request body has been read, and the request's watch."""
    conn = Connection()
    request = Request({"type": "http", "method": "POST", "path": "/", "headers": []}, conn.receive)
    await request.body()
    watch = ClientWatch.of(request)
    assert ClientWatch.of(request) is watch
    return conn, watch


def test_the_work_runs_in_the_callers_task_and_one_watcher_serves_every_phase() -> None:
    async def main() -> None:
        conn, watch = await watched()

        async def where() -> asyncio.Task:
            return asyncio.current_task()

        assert await watch.guard(where()) is asyncio.current_task()
        assert await watch.guard(where()) is asyncio.current_task()
        await asyncio.sleep(0)
        assert conn.calls == 2  # the body, then one wait for the disconnect across both phases
        watch.close()

    asyncio.run(main())


def test_a_client_that_leaves_cancels_the_work_and_its_cleanup_runs() -> None:
    async def main() -> None:
        conn, watch = await watched()
        cleaned = asyncio.Event()

        async def slow() -> None:
            try:
                await asyncio.sleep(30)
            finally:
                cleaned.set()

        asyncio.get_running_loop().call_later(0.05, conn.left.set)
        with pytest.raises(ClientDisconnected):
            await watch.guard(slow())
        assert cleaned.is_set()
        assert asyncio.current_task().cancelling() == 0  # our cancel is taken back: the task goes on
        await asyncio.sleep(0)  # and can await again

        async def never() -> None:
            raise AssertionError("a request whose client left must not start more work")

        with pytest.raises(ClientDisconnected):
            await watch.guard(never())

    asyncio.run(main())


def test_a_cancel_from_elsewhere_stays_a_cancel() -> None:
    async def main() -> None:
        _, watch = await watched()
        task = asyncio.ensure_future(watch.guard(asyncio.sleep(30)))
        await asyncio.sleep(0.01)
        task.cancel()  # the server stopping, say: not a client that left
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not watch.gone
        watch.close()

    asyncio.run(main())


def test_a_cancel_the_work_swallowed_is_taken_back() -> None:
    async def main() -> None:
        conn, watch = await watched()

        async def stubborn() -> str:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                return "kept going"
            return "slept"

        asyncio.get_running_loop().call_later(0.05, conn.left.set)
        assert await watch.guard(stubborn()) == "kept going"
        assert asyncio.current_task().cancelling() == 0  # an asyncio.timeout in this task still works
        watch.close()

    asyncio.run(main())


def test_a_stream_that_fails_is_not_counted_as_a_client_leaving() -> None:
    async def main() -> None:
        _, watch = await watched()
        closed: list[bool] = []

        async def events():  # noqa: ANN202
            yield b"data: 1\n\n"
            raise ValueError("a bug of ours")

        async def send(message: dict) -> None:
            pass

        response = EventStreamResponse(events(), on_close=closed.append, watch=watch)
        with pytest.raises(ValueError):
            await response({"type": "http"}, watch._receive, send)
        assert closed == [False]

    asyncio.run(main())
