"""Multiplexed calls (``node_runtime.mux_server`` on a real grpc.aio server, ``proxy.link.mux_client`` as
its client, ``cluster.mux_wire`` between them): each call behaves as the same call on its own, however many
share the stream."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from cluster import mux_wire
from cluster.mux_wire import merged
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from cluster.proto_gen import pdcluster_v1_pb2_grpc as pb_grpc
from node_runtime.mux_server import DecodeEventsMux, DecodeMux, Form, PrefillMux
from proxy.link import mux_client


def _tokens(rid: str, ids: list[int], finish: str = "") -> tuple[str, str, pb.DecodeEvent]:
    return rid, "event", pb.DecodeEvent(tokens=pb.Tokens(tokens=[pb.Token(token_id=t) for t in ids],
                                                          finish_reason=finish))


def test_merged_joins_a_requests_queued_tokens_only() -> None:
    admitted = ("a", "event", pb.DecodeEvent(admitted=pb.Admitted()))
    out = merged([_tokens("a", [1]), _tokens("b", [7]), _tokens("a", [2, 3]), admitted, _tokens("a", [4]),
                  _tokens("a", [5], "length"), _tokens("a", [6]), _tokens("b", [8], "stop")])
    got = [(rid, event.WhichOneof("event"), [t.token_id for t in event.tokens.tokens], event.tokens.finish_reason)
           for rid, _, event in out]
    assert got == [("a", "tokens", [1, 2, 3], ""), ("b", "tokens", [7, 8], "stop"), ("a", "admitted", [], ""),
                   ("a", "tokens", [4, 5], "length"), ("a", "tokens", [6], "")]


class Prefill(PrefillMux, pb_grpc.PrefillServiceServicer):
    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def Prefill(self, request: pb.PrefillRequest, context: Any) -> pb.PrefillResponse:  # noqa: N802
        if not request.token_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "token_ids is empty")
        if request.token_ids[0] == 0:
            raise RuntimeError("a bug")
        try:
            await asyncio.sleep(request.token_ids[0] / 1000)
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        return pb.PrefillResponse(request_id=request.request_id, first_token=pb.Token(token_id=len(request.token_ids)))


class Decode(DecodeEventsMux, pb_grpc.DecodeServiceServicer):
    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def Decode(self, request: pb.DecodeRequest, context: Any) -> Any:  # noqa: N802
        n = request.sampling.max_tokens
        if n == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens is 0")
        try:
            yield pb.DecodeEvent(admitted=pb.Admitted(dp_rank=1))
            for i in range(n):
                await asyncio.sleep(0.001)
                if request.first_token.token_id == 98:
                    await asyncio.sleep(3600)
                if request.first_token.token_id == 99 and i == 2:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "injected")
                yield pb.DecodeEvent(tokens=pb.Tokens(tokens=[pb.Token(token_id=i)],
                                                      finish_reason="length" if i == n - 1 else ""))
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise


async def _serve() -> tuple[grpc.aio.Server, Prefill, Decode, int]:
    server = grpc.aio.server()
    prefill, decode = Prefill(), Decode()
    pb_grpc.add_PrefillServiceServicer_to_server(prefill, server)
    pb_grpc.add_DecodeServiceServicer_to_server(decode, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, prefill, decode, port


async def _read_all(call: mux_client.DecodeCall) -> list[int]:
    ids = []
    while (event := await call.read(5.0)) is not grpc.aio.EOF:
        ids += [t.token_id for t in event.tokens.tokens]
    return ids


def test_many_calls_share_one_stream_each_as_on_its_own() -> None:
    async def main() -> None:
        server, prefill_servicer, decode_servicer, port = await _serve()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            p = mux_client.MuxStream(ch, mux_wire.PREFILL)
            d = mux_client.MuxStream(ch, mux_wire.DECODE)
            # prefill: answers out of order, by their own delays; a bad one and a buggy one fail alone
            replies = await asyncio.gather(*(mux_client.prefill(p, pb.PrefillRequest(request_id=f"p{i}",
                                                                                     token_ids=[20 - i] * (i + 1)), 5.0)
                                             for i in range(10)))
            assert [r.first_token.token_id for r in replies] == list(range(1, 11))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await mux_client.prefill(p, pb.PrefillRequest(request_id="bad"), 5.0)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await mux_client.prefill(p, pb.PrefillRequest(request_id="bug", token_ids=[0]), 5.0)
            assert e.value.code() == grpc.StatusCode.UNKNOWN and "a bug" in e.value.details()
            # a deadline: DEADLINE_EXCEEDED here, the call cancelled on the node
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await mux_client.prefill(p, pb.PrefillRequest(request_id="slow", token_ids=[3000]), 0.05)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            for _ in range(100):
                if "slow" in prefill_servicer.cancelled:
                    break
                await asyncio.sleep(0.01)
            assert prefill_servicer.cancelled == ["slow"]

            # decode: concurrent streams get their own events, in order; an abort ends one stream only
            calls = [mux_client.DecodeCall(d, pb.DecodeRequest(request_id=f"d{i}", sampling=pb.SamplingParams(
                max_tokens=5 + i))) for i in range(8)]
            failing = mux_client.DecodeCall(d, pb.DecodeRequest(request_id="f", first_token=pb.Token(token_id=99),
                                                                sampling=pb.SamplingParams(max_tokens=9)))
            refused = mux_client.DecodeCall(d, pb.DecodeRequest(request_id="r"))
            outs = await asyncio.gather(*(_read_all(c) for c in calls))
            assert outs == [list(range(5 + i)) for i in range(8)]
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _read_all(failing)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await refused.read(5.0)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            # cancel: the node's handler is cancelled (it frees the request); the stream goes on
            long = mux_client.DecodeCall(d, pb.DecodeRequest(request_id="long",
                                                             sampling=pb.SamplingParams(max_tokens=10**6)))
            assert (await long.read(5.0)).WhichOneof("event") == "admitted"
            long.cancel()
            for _ in range(100):
                if "long" in decode_servicer.cancelled:
                    break
                await asyncio.sleep(0.01)
            assert decode_servicer.cancelled == ["long"]
            again = mux_client.DecodeCall(d, pb.DecodeRequest(request_id="long",
                                                              sampling=pb.SamplingParams(max_tokens=3)))
            assert await _read_all(again) == [0, 1, 2]  # the id is free again
            # a read with nothing coming times out
            stalled = mux_client.DecodeCall(d, pb.DecodeRequest(request_id="s", first_token=pb.Token(token_id=98),
                                                                sampling=pb.SamplingParams(max_tokens=5)))
            assert (await stalled.read(5.0)).WhichOneof("event") == "admitted"
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                await stalled.read(0.2)
            assert 0.2 <= time.monotonic() - t0 < 0.4
            # A short read while a long one waits is not held to the long one's timer.
            patient = mux_client.DecodeCall(d, pb.DecodeRequest(request_id="p", first_token=pb.Token(token_id=98),
                                                                sampling=pb.SamplingParams(max_tokens=5)))
            assert (await patient.read(5.0)).WhichOneof("event") == "admitted"
            long_wait = asyncio.ensure_future(patient.read(60.0))
            await asyncio.sleep(0.01)
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):  # every read has its own deadline
                await stalled.read(0.05)
            assert time.monotonic() - t0 < 0.25 and not long_wait.done()
            long_wait.cancel()
            stalled.cancel()
            patient.cancel()
            await asyncio.sleep(0)
            assert not d.waiting  # no read left registered with the timer
            assert not d.broken and not p.broken

            # the node goes away: every call still on the stream fails UNAVAILABLE, none hangs
            pending = [mux_client.DecodeCall(d, pb.DecodeRequest(request_id=f"x{i}", sampling=pb.SamplingParams(
                max_tokens=10**6))) for i in range(3)]
            for c in pending:
                await c.read(5.0)
            await server.stop(grace=None)
            for c in pending:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await _read_all(c)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert d.broken

    asyncio.run(main())


def test_a_call_cancelled_before_it_is_written_never_reaches_the_node() -> None:
    """Cancelled within the writer's turn, a call leaves nothing on the node (a cancel sent with its call
    would reach the node first, find nothing running, and the call would run to its end)."""
    async def main() -> None:
        server, _, decode_servicer, port = await _serve()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            d = mux_client.MuxStream(ch, mux_wire.DECODE)
            early = mux_client.DecodeCall(d, pb.DecodeRequest(request_id="early", sampling=pb.SamplingParams(
                max_tokens=10**6)))
            early.cancel()  # before the writer's turn
            after = mux_client.DecodeCall(d, pb.DecodeRequest(request_id="after",
                                                              sampling=pb.SamplingParams(max_tokens=3)))
            assert await _read_all(after) == [0, 1, 2]
            again = mux_client.DecodeCall(d, pb.DecodeRequest(request_id="early",
                                                              sampling=pb.SamplingParams(max_tokens=2)))
            assert await _read_all(again) == [0, 1]  # the node never had "early" running: the id was free
            assert decode_servicer.cancelled == []
        await server.stop(grace=None)

    asyncio.run(main())


def test_a_failed_reader_ends_the_stream_with_its_error_despite_replies_behind_it() -> None:
    """The calls stream failing while handlers still queue replies: the node's stream ends with the
    reader's error rather than writing on forever."""
    from node_runtime.mux_server import CallContext, serve

    async def main() -> None:
        async def calls() -> Any:
            yield pb.DecodeCalls(calls=[pb.DecodeRequest(request_id="busy")])
            await asyncio.sleep(0.01)
            raise RuntimeError("the client's stream broke")

        async def handler(call: Any, context: CallContext) -> Any:
            for i in range(3000):
                yield pb.DecodeEvent(tokens=pb.Tokens(tokens=[pb.Token(token_id=i)]))
                await asyncio.sleep(0)

        with pytest.raises(RuntimeError, match="stream broke"):
            async for _ in serve(calls(), handler, Form.EVENTS):
                pass

    asyncio.run(asyncio.wait_for(main(), 10))


def test_the_stream_writes_the_bytes_of_the_generated_message() -> None:
    """The writer frames each serialized call itself: the node must read exactly the message the
    generated class would have written, calls and cancels, long prompts (multi-byte lengths) too."""
    sampling = pb.SamplingParams(max_tokens=16, temperature=0.5)
    prefills = [pb.PrefillRequest(request_id=f"p{i}", token_ids=list(range(n)), sampling=sampling, dp_rank=i % 2)
                for i, n in enumerate((1, 100, 3000))]
    decodes = [pb.DecodeRequest(request_id="d", prompt_token_ids=[5] * 70000, first_token=pb.Token(token_id=7))]
    for service, calls_type, calls in ((mux_wire.PREFILL, pb.PrefillCalls, prefills),
                                       (mux_wire.DECODE, pb.DecodeCalls, decodes)):
        for some, cancels in ((calls, []), (calls, ["x", "y"]), ([], ["z"]), ([], [])):
            raw = service.encode(some, cancels)
            assert raw == calls_type(calls=some, cancel=cancels).SerializeToString()
            assert calls_type.FromString(raw) == calls_type(calls=some, cancel=cancels)


def test_sink_calls_send_their_events_then_their_status_and_nothing_once_cancelled() -> None:
    """``decode_into``-style handlers (``Form.SINK``): events sent from outside the handler's task reach the
    stream in order before the call's status; an aborted call ends with its status; a cancelled call's
    later events are dropped (its handler freed the request, as a cancelled ``Decode`` does)."""
    from node_runtime.mux_server import CallAborted, CallContext, serve

    async def main() -> list[tuple[str, str, Any]]:
        sends: dict[str, Any] = {}
        ends: dict[str, asyncio.Future] = {}
        go_on = asyncio.Event()

        async def calls() -> Any:
            yield pb.DecodeCalls(calls=[pb.DecodeRequest(request_id=r) for r in ("ok", "bad", "gone")])
            await go_on.wait()
            yield pb.DecodeCalls(cancel=["gone"])
            await asyncio.sleep(0.05)
            for rid in ("ok", "bad", "gone"):  # an engine step after the cancel
                sends[rid](_tokens(rid, [9])[2])
            ends["ok"].set_result(None)
            ends["bad"].set_result(CallAborted(grpc.StatusCode.FAILED_PRECONDITION, "lost"))

        async def handler(call: Any, context: CallContext, send: Any) -> None:
            sends[call.request_id] = send
            end = ends[call.request_id] = asyncio.get_running_loop().create_future()
            send(_tokens(call.request_id, [1])[2])  # as an engine step delivers, outside this task too
            if len(sends) == 3:
                go_on.set()
            failure = await end
            if failure is not None:
                raise failure

        got: list[tuple[str, str, Any]] = []
        async for message in serve(calls(), handler, Form.SINK):
            for r in message.replies:
                kind = r.WhichOneof("reply")
                got.append((r.request_id, kind, [t.token_id for t in r.event.tokens.tokens] if kind == "event"
                            else r.status.code))
        return got

    got = asyncio.run(asyncio.wait_for(main(), 10))
    assert [g for g in got if g[0] == "ok"] == [("ok", "event", [1]), ("ok", "event", [9]),
                                                ("ok", "status", grpc.StatusCode.OK.value[0])]
    assert [g for g in got if g[0] == "bad"] == [("bad", "event", [1]), ("bad", "event", [9]),
                                                 ("bad", "status", grpc.StatusCode.FAILED_PRECONDITION.value[0])]
    assert [g for g in got if g[0] == "gone"] == [("gone", "event", [1])]


def test_each_decode_mixin_runs_the_handler_it_declares() -> None:
    """``DecodeMux`` runs the servicer's ``decode_into`` (``Form.SINK``), ``DecodeEventsMux`` its ``Decode``
    (``Form.EVENTS``), whatever else the servicer has: the mixin says which, nothing is looked up."""

    class Both:
        async def Decode(self, request: pb.DecodeRequest, context: Any) -> Any:  # noqa: N802
            yield pb.DecodeEvent(tokens=pb.Tokens(tokens=[pb.Token(token_id=1)], finish_reason="stop"))

        async def decode_into(self, request: pb.DecodeRequest, context: Any, send: Any) -> None:
            send(pb.DecodeEvent(tokens=pb.Tokens(tokens=[pb.Token(token_id=2)], finish_reason="stop")))

    class Sink(DecodeMux, Both, pb_grpc.DecodeServiceServicer):
        pass

    class Events(DecodeEventsMux, Both, pb_grpc.DecodeServiceServicer):
        pass

    async def first_token(servicer: Any) -> list[int]:
        server = grpc.aio.server()
        pb_grpc.add_DecodeServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            d = mux_client.MuxStream(ch, mux_wire.DECODE)
            ids = await _read_all(mux_client.DecodeCall(d, pb.DecodeRequest(request_id="a")))
            d.close()
        await server.stop(grace=None)
        return ids

    assert asyncio.run(first_token(Sink())) == [2]
    assert asyncio.run(first_token(Events())) == [1]
