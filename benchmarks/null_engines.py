"""Null engines for ``benchmarks/proxy.py``: engines that answer at once, behind each front end.

Ours: a null prefill and a null decode node (grpc.aio, the real ``pdcluster.v1`` contract and the node
runtime's multiplexed calls, registered in Redis as nodes register); the decode node steps one loop for
its whole batch, as a real engine, and hands each step's events to the calls as the decode node does
(``outbox.deliver`` into ``DecodeService``'s ``call_sink``, straight onto the mux's queue).
vllm-router's: a null vLLM OpenAI server per role (aiohttp; the prefill answers one token with
``kv_transfer_params``, the decode streams from each request's handler, as an aiohttp server does).
``Pacer`` says when the next token is made (``--pacing`` of the benchmark).
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any

MODEL = "tiny"


class Pacer:
    """When a null engine makes its next token: at once (burst), after one turn of the event loop
    (turn), or at the next step of the engine's one clock (step: every ``step_s``, for all streams)."""

    def __init__(self, pacing: str, step_s: float) -> None:
        self.pacing = pacing
        self.step_s = step_s
        self._tick: asyncio.Future[None] | None = None

    async def next(self) -> None:
        if self.pacing == "turn":
            await asyncio.sleep(0)
        elif self.pacing == "step":
            if self._tick is None:
                loop = asyncio.get_running_loop()
                self._tick = loop.create_future()
                loop.call_later(self.step_s, self._fire)
            await asyncio.shield(self._tick)  # every stream waits on the same step

    def _fire(self) -> None:
        tick, self._tick = self._tick, None
        if tick is not None:
            tick.set_result(None)


def serve_null_grpc(redis_url: str, cluster: str, max_model_len: int, pacer: Pacer, role: str, index: int = 0) -> None:
    """A null ``role`` ("prefill" or "decode") node in this process, registered like a real node (``index``:
    one of several such nodes of the role). One role a process, as real nodes and the null vLLM servers
    are: a decode node's steps do not wait on a prefill node's work."""
    import grpc

    from cluster.config import RegistryConfig
    from cluster.nodes import NodeInfo, ReplicaLoad
    from cluster.proto_gen import pdcluster_v1_pb2 as pb
    from cluster.proto_gen import pdcluster_v1_pb2_grpc as pb_grpc
    from cluster.registry import Registry
    from decode_node.outbox import deliver
    from decode_node.service import call_sink
    from node_runtime.mux_server import DecodeMux, PrefillMux
    from node_runtime.server import run_loop

    def token_event(i: int, n: int) -> pb.DecodeEvent:
        return pb.DecodeEvent(tokens=pb.Tokens(tokens=[pb.Token(token_id=300 + i % 200, logprob=-0.1)],
                                               finish_reason="length" if i == n - 1 else ""))

    class Prefill(PrefillMux, pb_grpc.PrefillServiceServicer):
        async def Prefill(self, request: pb.PrefillRequest, context: Any) -> pb.PrefillResponse:  # noqa: N802
            reply = pb.PrefillResponse(request_id=request.request_id, first_token=pb.Token(token_id=300, logprob=-0.1))
            reply.kv.prefill_address = "null"
            return reply

        async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:  # noqa: N802
            return pb.ReleaseResponse(found=True)

        async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortResponse:  # noqa: N802
            return pb.AbortResponse(found=False)

    class Decode(DecodeMux, pb_grpc.DecodeServiceServicer):
        def __init__(self) -> None:
            self.streams: dict[int, list] = {}  # the running batch: key -> [its job (a sink), made, wanted]
            self.more = asyncio.Event()
            self.keys = 0
            self.engine: asyncio.Task | None = None

        async def step_loop(self) -> None:
            """The null engine: one loop for the whole batch, as a real engine's steps, making the next
            token of every stream at each step (the pacer's: a turn of the event loop, or a step of
            ``--step-ms``) and handing the step's events over at once, as the node's outbox does."""
            while True:
                if not self.streams:
                    self.more.clear()
                    await self.more.wait()
                await pacer.next()
                step: list[tuple[Any, Any]] = []
                for key, stream in list(self.streams.items()):
                    job, i, n = stream
                    step.append((job, token_event(i, n)))
                    stream[1] = i + 1
                    if i + 1 == n:
                        step.append((job, None))
                        del self.streams[key]
                deliver(step)

        async def decode_into(self, request: pb.DecodeRequest, context: Any, send: Any) -> None:
            # As the decode node's DecodeService.decode_into: the events go to the mux's queue from the
            # engine step's hand-over (``outbox.deliver``); this task waits for the end only.
            if self.engine is None:
                self.engine = asyncio.ensure_future(self.step_loop())
            sink, done = call_sink(send)
            job = SimpleNamespace(sink=sink)
            self.keys += 1
            key = self.keys
            n = request.sampling.max_tokens
            events: list[tuple[Any, Any]] = [(job, pb.DecodeEvent(admitted=pb.Admitted(dp_rank=0)))]
            if n <= 1:
                events.append((job, None))
            elif pacer.pacing == "burst":
                events += [(job, token_event(i, n)) for i in range(1, n)] + [(job, None)]
            else:
                self.streams[key] = [job, 1, n]
                self.more.set()
            deliver(events)
            try:
                await done
            finally:
                self.streams.pop(key, None)

        async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortResponse:  # noqa: N802
            return pb.AbortResponse(found=False)

    async def main() -> None:
        servicer, add = ((Prefill, pb_grpc.add_PrefillServiceServicer_to_server) if role == "prefill"
                         else (Decode, pb_grpc.add_DecodeServiceServicer_to_server))
        server = grpc.aio.server()
        add(servicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        registry = Registry(RegistryConfig(url=redis_url, cluster=cluster))
        info = NodeInfo(node_id=f"null-{role}-{index}", role=role, address=f"127.0.0.1:{port}", model=MODEL,
                        max_model_len=max_model_len, dp=1, pcp=1, pp=1, kv_layout="replicated", block_size=16,
                        num_blocks=1 << 20, started_at=time.time())
        print(json.dumps({role: port}), flush=True)
        while True:
            registry.heartbeat(info, [ReplicaLoad(dp_rank=0, free_blocks=1 << 20)])
            await asyncio.sleep(1.0)

    run_loop(main())  # the event loop a real node runs on


def serve_null_http(role: str, port: int, pacer: Pacer) -> None:
    """A null vLLM OpenAI server: prefill answers one token with kv_transfer_params, decode streams."""
    from aiohttp import web

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"id": "cmpl-null", "object": "text_completion", "model": MODEL,
                                      "choices": [{"index": 0, "text": " t", "finish_reason": "length"}],
                                      "kv_transfer_params": {"remote_engine_id": "null", "remote_block_ids": [0]},
                                      "usage": {"prompt_tokens": len(body.get("prompt", [])), "completion_tokens": 1,
                                                "total_tokens": len(body.get("prompt", [])) + 1}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = int(body.get("max_tokens", 16))
        for i in range(n):
            if i:
                await pacer.next()
            chunk = {"id": "cmpl-null", "object": "text_completion", "model": MODEL,
                     "choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if i == n - 1 else None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", health)
    app.router.add_post("/v1/completions", completions)
    import uvloop

    # On uvloop, as vLLM's OpenAI server runs.
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, loop=uvloop.new_event_loop())
