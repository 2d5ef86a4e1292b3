"""Fake prefill and decode nodes (grpc.aio servers on one background loop) and a proxy in a thread.

The fakes speak the real ``pdcluster.v1`` contract and generate a scripted output: output token
``i`` is ``script[i]``, then EOS. Fault knobs live here, never in the proxy:

- prefill: ``fail`` (a status code to answer with), ``stall_s`` (wait before answering);
- decode: ``fail_after`` (abort with UNAVAILABLE after that many token events), ``refuse`` (a
  status code to answer before any event, while ``refusals`` lasts), ``stall_after`` (stop sending
  after that many token events), ``delay_s`` (between events).

What the fakes assume of the real nodes: Prefill answers the first output token and, unless that
token ended the request (``max_tokens`` 1, or EOS), a KV handle that it holds until Release or
Abort; Decode sends one ``admitted`` event (after Release on the prefill node), then ``tokens``
events of new tokens (not the first one), the last with a finish reason, and counts the first
token in ``max_tokens``. Logprobs are real numbers only when ``sampling.logprobs`` is set.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster.auth import call_metadata
from cluster.net import free_port
from cluster.nodes import NodeInfo, NodeState, ReplicaLoad
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from cluster.proto_gen import pdcluster_v1_pb2_grpc as pb_grpc
from cluster.registry import Registry
from node_runtime.mux_server import DecodeEventsMux, PrefillMux
from proxy.app import create_app, model_limits

T = TypeVar("T")


class Script:
    """The output every fake produces: ``tokens`` then EOS."""

    def __init__(self, tokens: list[int], eos_id: int) -> None:
        self.tokens = tokens
        self.eos_id = eos_id

    def token_at(self, i: int) -> int:
        return self.tokens[i] if i < len(self.tokens) else self.eos_id


def make_token(token_id: int, i: int, sampling: pb.SamplingParams) -> pb.Token:
    if not sampling.HasField("logprobs"):
        return pb.Token(token_id=token_id, logprob=math.nan)
    lp = -0.1 * (i + 1)
    top = [pb.TopLogprob(token_id=token_id, logprob=lp)]
    top += [pb.TopLogprob(token_id=token_id + k, logprob=lp - k) for k in range(1, sampling.logprobs)]
    return pb.Token(token_id=token_id, logprob=lp, top=top[:sampling.logprobs])


def _finish(i: int, token_id: int, script: Script, sampling: pb.SamplingParams) -> str:
    """The finish reason after output token ``i`` (0-based), or ""."""
    if token_id == script.eos_id and not sampling.ignore_eos:
        return "stop"
    return "length" if i + 1 >= sampling.max_tokens else ""


class FakePrefill(PrefillMux, pb_grpc.PrefillServiceServicer):
    def __init__(self, node_id: str, script: Script) -> None:
        self.node_id = node_id
        self.address = ""
        self.script = script
        self.reset()

    def reset(self) -> None:
        self.fail: grpc.StatusCode | None = None
        self.stall_s = 0.0
        self.requests: list[pb.PrefillRequest] = []
        self.aborts: list[str] = []
        self.released: list[str] = []
        self.held: set[str] = set()
        self.vllm_params = False  # answer vLLM's kv_transfer_params instead of a KV handle

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        self.requests.append(request)
        if self.stall_s:
            await asyncio.sleep(self.stall_s)
        if self.fail is not None:
            await context.abort(self.fail, f"injected {self.fail.name}")
        if not request.token_ids or not request.sampling.max_tokens:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty prompt or max_tokens 0")
        first = self.script.token_at(0)
        finish = _finish(0, first, self.script, request.sampling)
        reply = pb.PrefillResponse(request_id=request.request_id, dp_rank=max(0, request.dp_rank),
                                   first_token=make_token(first, 0, request.sampling), finish_reason=finish)
        if not finish:
            self.held.add(request.request_id)
            if self.vllm_params:  # as a vLLM prefill node answers
                reply.vllm_kv_params_json = json.dumps({"fake": request.request_id, "release_to": self.address})
            else:
                reply.kv.CopyFrom(pb.KVHandle(prefill_node_id=self.node_id, prefill_address=self.address,
                                              dp_rank=reply.dp_rank, num_blocks=-(-len(request.token_ids) // 16),
                                              block_size=16, transport="fake", lease_s=30.0))
        return reply

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        self.released.append(request.request_id)
        found = request.request_id in self.held
        self.held.discard(request.request_id)
        return pb.ReleaseResponse(found=found)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        self.aborts.append(request.request_id)
        found = request.request_id in self.held
        self.held.discard(request.request_id)
        return pb.AbortResponse(found=found)


class FakeDecode(DecodeEventsMux, pb_grpc.DecodeServiceServicer):
    def __init__(self, node_id: str, script: Script) -> None:
        self.node_id = node_id
        self.address = ""
        self.script = script
        self.reset()

    def reset(self) -> None:
        self.fail_after: int | None = None
        self.refuse: grpc.StatusCode | None = None  # answer this before any event ...
        self.refusals = [0]  # ... while this count (a list: fakes may share it) is above 0
        self.stall_after: int | None = None
        self.delay_s = 0.0
        self.tokens_per_event = 2
        self.requests: list[pb.DecodeRequest] = []
        self.cancelled: list[str] = []
        self.finished: list[str] = []

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> Any:
        self.requests.append(request)
        rid, sampling = request.request_id, request.sampling
        release_to = (json.loads(request.vllm_kv_params_json)["release_to"] if request.vllm_kv_params_json
                      else request.kv.prefill_address)
        if request.first_token.token_id != self.script.token_at(0) or not release_to:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first token or KV handle missing")
        if self.refuse is not None and self.refusals[0] > 0:
            self.refusals[0] -= 1
            await context.abort(self.refuse, f"injected {self.refuse.name}")
        ended = False  # finished, or failed on purpose; anything else is the client cancelling
        try:
            async with grpc.aio.insecure_channel(release_to) as ch:  # "the KV is here"
                await pb_grpc.PrefillServiceStub(ch).Release(pb.ReleaseRequest(request_id=rid), timeout=5,
                                                             metadata=call_metadata())  # as a decode node does
            yield pb.DecodeEvent(admitted=pb.Admitted(dp_rank=max(0, request.dp_rank), transfer_bytes=4096,
                                                      transfer_s=0.002))
            i, events = 1, 0
            while True:
                if self.fail_after is not None and events >= self.fail_after:
                    ended = True
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "injected: decode node died")
                if self.stall_after is not None and events >= self.stall_after:
                    await asyncio.sleep(3600)
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                batch, finish = [], ""
                while len(batch) < self.tokens_per_event and not finish:
                    tok = self.script.token_at(i)
                    batch.append(make_token(tok, i, sampling))
                    finish = _finish(i, tok, self.script, sampling)
                    i += 1
                events += 1
                if finish:
                    ended = True
                    self.finished.append(rid)
                yield pb.DecodeEvent(tokens=pb.Tokens(tokens=batch, finish_reason=finish))
                if finish:
                    return
        finally:
            # Cancellation may reach the handler inside gRPC's send (the generator then gets
            # GeneratorExit at its yield) or at an await here (CancelledError): finally sees both.
            if not ended:
                self.cancelled.append(rid)


class FakeNodes:
    """Fake node servers on one event loop in a background thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fake-nodes", daemon=True)
        self._thread.start()
        self._servers: list[grpc.aio.Server] = []

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    def serve(self, servicer: FakePrefill | FakeDecode, interceptors: Sequence[Any] = ()) -> str:
        async def start() -> str:
            server = grpc.aio.server(interceptors=list(interceptors) or None)
            if isinstance(servicer, FakePrefill):
                pb_grpc.add_PrefillServiceServicer_to_server(servicer, server)
            else:
                pb_grpc.add_DecodeServiceServicer_to_server(servicer, server)
            servicer.health = health.aio.HealthServicer()  # SERVING for "", as a real node once registered
            await servicer.health.set("", health_pb2.HealthCheckResponse.SERVING)
            health_pb2_grpc.add_HealthServicer_to_server(servicer.health, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            self._servers.append(server)
            return f"127.0.0.1:{port}"

        servicer.address = self.call(start())
        return servicer.address

    def stop(self) -> None:
        async def stop_all() -> None:
            await asyncio.gather(*(s.stop(0) for s in self._servers))

        self.call(stop_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.loop.close()


def node_state(node_id: str, role: str, address: str, *, model: str, max_model_len: int, dp: int = 1, pcp: int = 1,
               num_blocks: int = 1000, replicas: tuple[ReplicaLoad, ...] | None = None,
               prefix_caching: bool = False) -> NodeState:
    info = NodeInfo(node_id=node_id, role=role, address=address, model=model, max_model_len=max_model_len, dp=dp,
                    pcp=pcp, pp=1, kv_layout="sharded" if role == "prefill" else "replicated", block_size=16,
                    num_blocks=num_blocks, started_at=time.time(), prefix_caching=prefix_caching)
    if replicas is None:
        replicas = tuple(ReplicaLoad(dp_rank=r, free_blocks=num_blocks) for r in range(dp))
    return NodeState(info=info, replicas=replicas, heartbeat_at=time.time())


@contextmanager
def heartbeating(registry: Registry, states: Sequence[NodeState], every_s: float = 0.3) -> Iterator[None]:
    """Heartbeat ``states`` into ``registry`` from a thread while the block runs, as nodes do: a
    Redis that is away is tried again at the next beat."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            for s in states:
                try:
                    registry.heartbeat(s.info, s.replicas)
                except Exception:  # Redis away (a test stops it on purpose): keep beating
                    pass
            stop.wait(every_s)

    thread = threading.Thread(target=beat, name="fake-heartbeats", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


class ProxyServer:
    """A uvicorn server for an app, in a thread, on a free port."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="proxy", daemon=True)

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the proxy did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


@contextmanager
def running_proxy(config: Any, tokenizer: Any, source: Any) -> Iterator[tuple[str, Any]]:
    """The proxy app over ``source``'s nodes, served in a thread: (its URL, the app)."""
    app = create_app(config, tokenizer, source, max_model_len=4096, vocab_size=model_limits(config.model)[1])
    server = ProxyServer(app)
    server.start()
    try:
        yield server.url, app
    finally:
        server.stop()


@contextmanager
def settled(app: Any, prefills: list[FakePrefill], decodes: list[FakeDecode]) -> Iterator[None]:
    """Around one test: fresh fakes and no unreachable marks before; after, whatever the test did,
    nothing in flight in the proxy and no KV held on the fake prefill nodes."""
    for fake in (*prefills, *decodes):
        fake.reset()
    app.state.proxy.view.clear_unreachable()  # a fake that failed in the last test is back
    yield
    load = app.state.proxy.router.load
    ids = [f.node_id for f in (*prefills, *decodes)]
    assert wait_until(lambda: all(load.requests(i) == 0 for i in ids), 3)
    assert wait_until(lambda: not any(f.held for f in prefills), 3), "prefill KV left held"


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()
