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

    def sink(self, item: object) -> None:  # as DecodeService's: onto the stream's queue
        self.events.put_nowait(item)


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


# -- the node's side: events relayed from a replica process, the pipe's pickling fallback, failures ---
def _worker(streams: dict) -> object:
    """A DecodeWorker's relaying half over ``streams`` (all on replica 0), without replicas."""
    import threading as th

    from decode_node.worker import DecodeWorker, Stream

    worker = object.__new__(DecodeWorker)
    worker._lock = th.Lock()
    worker._streams = {rid: Stream(rid, 0, s.loop, s.sink) for rid, s in streams.items()}
    worker._per_replica = [len(streams)]
    worker.failed = th.Event()
    return worker


def test_node_side_dispatch_fails_only_the_stream_whose_event_does_not_parse() -> None:
    import threading as th

    from cluster.proto_gen import pdcluster_v1_pb2 as pb
    from decode_node.replica_process import Events, ReplicaProcesses

    loop = asyncio.new_event_loop()
    runner = th.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        jobs = {rid: _Stream(rid, loop, asyncio.Queue()) for rid in ("a", "b", "c")}
        worker = _worker(jobs)
        procs = object.__new__(ReplicaProcesses)
        procs._relay = worker.relay  # type: ignore[attr-defined]
        admitted = pb.DecodeEvent(admitted=pb.Admitted(dp_rank=0)).SerializeToString()
        procs._dispatch(0, Events([("a", admitted), ("b", b"\xff\xff not a message"), ("c", None), ("gone", None)]))

        async def take(q: asyncio.Queue) -> object:
            return await q.get()

        got = {rid: asyncio.run_coroutine_threadsafe(take(j.events), loop).result(timeout=5)
               for rid, j in jobs.items()}
        assert isinstance(got["a"], pb.DecodeEvent) and got["a"].HasField("admitted")
        assert isinstance(got["b"], RuntimeError) and "did not parse" in str(got["b"])
        assert got["c"] is None
        assert set(worker._streams) == {"a"} and worker.in_flight() == 1  # b and c ended: out of the table
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(timeout=5)


class _Unpicklable(Exception):
    def __init__(self) -> None:
        super().__init__("holds a lambda")
        self.fn = lambda: None


def test_pipe_fallback_replaces_only_the_exceptions_that_do_not_pickle() -> None:
    import pickle
    from types import SimpleNamespace

    from decode_node.replica_process import Events, _Link

    sent: list = []

    def send(msg: object) -> None:
        pickle.dumps(msg)
        sent.append(msg)

    link = object.__new__(_Link)
    link.conn = SimpleNamespace(send=send)  # type: ignore[assignment]
    import threading as th
    link.lock = th.Lock()
    link.send(Events([("a", ValueError("bad request")), ("b", _Unpicklable()), ("c", b"ev"), ("d", None)]))
    (msg,) = sent
    items = dict(msg.items)
    assert isinstance(items["a"], ValueError) and str(items["a"]) == "bad request"  # kept: its status stays
    assert type(items["b"]) is RuntimeError and "_Unpicklable" in str(items["b"])
    assert items["c"] == b"ev" and items["d"] is None


def test_a_failing_replica_hands_over_what_it_emitted_before_failing_its_requests() -> None:
    from types import SimpleNamespace

    from decode_node.replica import Replica

    order: list = []
    owner = SimpleNamespace(fail=lambda why: order.append(("fail", why)))
    box = Outbox(lambda items: order.append(("events", [i for _, i in items])))
    replica = SimpleNamespace(outbox=box, owner=owner, index=0, requests={"r": "request-r"})
    box.put("q", "q's last tokens")
    box.put("q", None)
    Replica.on_failure(replica, RuntimeError("boom"))  # type: ignore[arg-type]
    assert order[0] == ("events", ["q's last tokens", None])  # before the node hears of the failure
    assert order[1][0] == "fail"
    assert replica.requests == {}

    # The node then ends the failed replica's streams with an error (those of other replicas it leaves).
    loop = asyncio.new_event_loop()
    try:
        streams = {rid: _Stream(rid, loop, asyncio.Queue()) for rid in ("r", "s")}
        worker = _worker(streams)
        worker._streams["s"].replica = 1
        worker._per_replica.append(0)
        worker.replica_failed(0, "replica 0: RuntimeError: boom")
        loop.run_until_complete(asyncio.sleep(0))
        assert isinstance(streams["r"].events.get_nowait(), RuntimeError)
        assert streams["s"].events.empty() and set(worker._streams) == {"s"}
        assert worker.failed.is_set() and "boom" in worker.failure
    finally:
        loop.close()
