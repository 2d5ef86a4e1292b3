"""A replica's events for its requests' streams, delivered together.

An engine step makes a token for every running request: at batch 64, one ``call_soon_threadsafe``
(a write to the event loop's wake-up pipe) per request and step, or one pickled pipe message per
request and step from a replica process, is host work on the engine thread between two steps. The
``Outbox`` collects what one iteration of the engine loop emits (``put``) and hands it over at once
(``flush``): one wake-up of each event loop, or one pipe message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

# (the request's DecodeJob: its ``loop`` and ``sink``; the event: a pb.DecodeEvent, an exception, or
# None at the end)
Item = tuple[Any, Any]


class Outbox:
    """Events buffered on the engine thread until ``flush`` hands them to ``deliver`` in one call."""

    def __init__(self, deliver: Callable[[list[Item]], None]) -> None:
        self._deliver = deliver
        self._items: list[Item] = []

    def put(self, stream: Any, item: Any) -> None:
        self._items.append((stream, item))

    def flush(self) -> None:
        if self._items:
            items, self._items = self._items, []
            self._deliver(items)


def to_loops(items: Sequence[Item]) -> None:
    """Hand each event to its stream's sink on the stream's event loop: one ``call_soon_threadsafe``
    per event loop (any thread)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Item]] = {}
    for stream, item in items:
        assert stream.loop is not None
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, group in by_loop.items():
        loop.call_soon_threadsafe(deliver, group)


def deliver(group: Sequence[Item]) -> None:
    """Each event to its stream's sink, in order (on the streams' event loop)."""
    for stream, item in group:
        stream.sink(item)
