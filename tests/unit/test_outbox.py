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


# -- the replica-process path: JobEvents on the node's side, the pipe's pickling fallback, failures ----
def test_node_side_dispatch_fails_only_the_stream_whose_event_does_not_parse() -> None:
    import threading as th
    from types import SimpleNamespace

    from cluster.proto_gen import pdcluster_v1_pb2 as pb
    from decode_node.replica_process import JobEvents, ReplicaProcesses

    loop = asyncio.new_event_loop()
    runner = th.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        jobs = {rid: _Stream(rid, loop, asyncio.Queue()) for rid in ("a", "b", "c")}
        for j in jobs.values():
            j.admitted = False  # type: ignore[attr-defined]
        replica = SimpleNamespace(jobs=dict(jobs))
        procs = object.__new__(ReplicaProcesses)
        procs.replicas = [replica]  # type: ignore[assignment]
        procs.lock = th.RLock()
        admitted = pb.DecodeEvent(admitted=pb.Admitted(dp_rank=0)).SerializeToString()
        procs._dispatch(0, JobEvents([("a", admitted), ("b", b"\xff\xff not a message"), ("c", None),
                                      ("gone", None)]))

        async def take(q: asyncio.Queue) -> object:
            return await q.get()

        got = {rid: asyncio.run_coroutine_threadsafe(take(j.events), loop).result(timeout=5)
               for rid, j in jobs.items()}
        assert isinstance(got["a"], pb.DecodeEvent) and jobs["a"].admitted  # type: ignore[attr-defined]
        assert isinstance(got["b"], RuntimeError) and "did not parse" in str(got["b"])
        assert got["c"] is None
        assert set(replica.jobs) == {"a"}  # b and c ended: out of the table
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

    from decode_node.replica_process import JobEvents, _Link

    sent: list = []

    def send(msg: object) -> None:
        pickle.dumps(msg)
        sent.append(msg)

    link = object.__new__(_Link)
    link.conn = SimpleNamespace(send=send)  # type: ignore[assignment]
    import threading as th
    link.lock = th.Lock()
    link.send(JobEvents([("a", ValueError("bad request")), ("b", _Unpicklable()), ("c", b"ev"), ("d", None)]))
    (msg,) = sent
    items = dict(msg.items)
    assert isinstance(items["a"], ValueError) and str(items["a"]) == "bad request"  # kept: its status stays
    assert type(items["b"]) is RuntimeError and "_Unpicklable" in str(items["b"])
    assert items["c"] == b"ev" and items["d"] is None


def test_a_failing_replica_hands_over_what_it_emitted_before_failing_its_requests() -> None:
    from types import SimpleNamespace

    from decode_node.worker import Replica

    order: list = []
    box = Outbox(lambda items: order.append(("events", [i for _, i in items])))
    worker = SimpleNamespace(fail=lambda why: order.append(("fail", why)))
    replica = SimpleNamespace(outbox=box, worker=worker, index=0, jobs={"r": "job-r"})
    box.put("job-q", "q's last tokens")
    box.put("job-q", None)
    Replica.on_failure(replica, RuntimeError("boom"))  # type: ignore[arg-type]
    assert order[0] == ("events", ["q's last tokens", None])  # before the node hears of the failure
    assert order[1][0] == "fail"
    assert order[2][0] == "events" and isinstance(order[2][1][0], RuntimeError)
    assert replica.jobs == {}
