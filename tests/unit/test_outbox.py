"""decode_node.outbox: a loop iteration's events reach their streams in order, in one hand-over."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

from decode_node.outbox import Outbox, to_loops


@dataclass
class _Stream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue


def test_flush_hands_over_once_and_only_what_was_put() -> None:
    calls: list[list] = []
    box = Outbox(calls.append)
    box.flush()
    assert calls == []  # nothing buffered: no hand-over
    box.put("a", 1)
    box.put("b", 2)
    box.put("a", 3)
    box.flush()
    box.flush()
    assert calls == [[("a", 1), ("b", 2), ("a", 3)]]


def test_to_loops_wakes_each_loop_once_and_keeps_each_streams_order() -> None:
    loops = [asyncio.new_event_loop() for _ in range(2)]
    threads = [threading.Thread(target=lp.run_forever, daemon=True) for lp in loops]
    for t in threads:
        t.start()
    try:
        streams = [_Stream(f"r{i}", loops[i % 2], asyncio.Queue()) for i in range(4)]
        wakeups = {id(lp): 0 for lp in loops}
        originals = {}
        for lp in loops:
            originals[id(lp)] = lp.call_soon_threadsafe

            def counted(cb, *args, _lp=lp):  # noqa: ANN001, ANN202
                wakeups[id(_lp)] += 1
                return originals[id(_lp)](cb, *args)

            lp.call_soon_threadsafe = counted  # type: ignore[method-assign]
        to_loops([(s, (s.request_id, k)) for k in range(3) for s in streams] + [(s, None) for s in streams])
        assert wakeups == {id(lp): 1 for lp in loops}

        async def drain(q: asyncio.Queue) -> list:
            out = []
            while (item := await q.get()) is not None:
                out.append(item)
            return out

        for s in streams:
            got = asyncio.run_coroutine_threadsafe(drain(s.events), s.loop).result(timeout=5)
            assert got == [(s.request_id, k) for k in range(3)]
    finally:
        for lp in loops:
            lp.call_soon_threadsafe(lp.stop)
        for t in threads:
            t.join(timeout=5)
