"""``python -m prefill_node --engine vllm``: ``PrefillService`` over a vLLM engine (``kv_producer``).

Prefill = vLLM generate with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``:
the answer carries the first token and vLLM's params for the decode side as
``vllm_kv_params_json`` (no ``KVHandle``). The connector keeps the blocks until the decode side's
connector says it has read them (or its lease ends), so Release is a no-op answering whether the
request was prefilled here; Abort is vLLM's abort. Imported only with ``--engine vllm``.
"""

from __future__ import annotations

import json
import logging
import time

import grpc

from cluster.config import NodeConfig
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from cluster.proto_gen import pdcluster_v1_pb2_grpc as pb_grpc
from node_runtime import server as node_runtime
from node_runtime.metrics import NodeMetrics
from node_runtime.mux_server import PrefillMux
from vllm_backend.engine import VllmWorker, finish_reason, prompt_tokens_pb, sampling_to_vllm, tokens_pb

log = logging.getLogger("pdcluster.prefill")
_RECENT = 4096  # prefilled request ids remembered for Release


class VllmPrefillService(PrefillMux, pb_grpc.PrefillServiceServicer):
    def __init__(self, worker: VllmWorker, node_id: str, state: node_runtime.Lifecycle, metrics: NodeMetrics) -> None:
        self.worker = worker
        self.node_id = node_id
        self.state = state
        self.metrics = metrics
        self.prefilled: dict[str, None] = {}  # insertion-ordered set

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        rid = request.request_id
        refused = self.worker.refusal(rid, "token_ids", bool(request.token_ids), request.dp_rank, self.state.stopping)
        if refused is not None:
            await context.abort(*refused)
        try:
            # max_tokens 1: the first token is the whole answer, nothing is kept for a decode side.
            remote = request.sampling.max_tokens > 1
            params = sampling_to_vllm(request.sampling, {"do_remote_decode": True} if remote else None, max_tokens=1)
            if request.sampling.HasField("prompt_logprobs"):  # echo with logprobs
                params.prompt_logprobs = int(request.sampling.prompt_logprobs)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        prompt = {"prompt_token_ids": list(request.token_ids)}
        arrival = time.monotonic()
        self.worker.begin(rid, len(request.token_ids))
        self.worker.active[rid] = "running"
        self.worker.tokens[rid] = len(request.token_ids)
        last = None
        try:
            async for out in self.worker.engine.generate(prompt, params, rid):
                last = out
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:  # the engine died
            self.worker.check()
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"vLLM failed: {e}")
        finally:  # a cancelled call (the proxy went away) is aborted by vLLM's generate itself
            self.worker.end(rid)
        if last is None or not last.outputs or not last.outputs[0].token_ids:
            await context.abort(grpc.StatusCode.ABORTED, f"request {rid} was aborted")
        assert last is not None  # (context.abort raises)
        done = time.monotonic() - arrival
        completion = last.outputs[0]
        kv = last.kv_transfer_params
        reason = "" if kv else finish_reason(completion)  # kv: held for the decode side, not finished
        if not kv and not reason:
            await context.abort(grpc.StatusCode.ABORTED, f"vLLM ended the request: {completion.finish_reason}")
        if remote and reason == "length":
            await context.abort(grpc.StatusCode.INTERNAL, "vLLM's connector returned no kv_transfer_params")
        self.worker.done += 1
        self._remember(rid)
        reply = pb.PrefillResponse(request_id=rid, dp_rank=0, first_token=tokens_pb(completion)[0],
                                   finish_reason=reason, queue_s=0.0, prefill_s=done,
                                   cached_tokens=last.num_cached_tokens or 0)  # vLLM's prefix cache hit
        if request.sampling.HasField("prompt_logprobs"):
            reply.prompt_tokens.extend(prompt_tokens_pb(list(request.token_ids), last.prompt_logprobs))
        if kv:  # the kv_source oneof stays unset when nothing is held
            reply.vllm_kv_params_json = json.dumps(kv)
        self.metrics.prefilled(arrival, len(request.token_ids), reply, None)  # vLLM's queue time is not visible
        return reply

    def _remember(self, rid: str) -> None:
        self.prefilled[rid] = None
        while len(self.prefilled) > _RECENT:
            self.prefilled.pop(next(iter(self.prefilled)))

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        # The connector frees on the decode side's notification (or at lease expiry).
        return pb.ReleaseResponse(found=request.request_id in self.prefilled)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        found = await self.worker.abort(request.request_id) or request.request_id in self.prefilled
        return pb.AbortResponse(found=found)

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        return pb.StatsResponse(node_id=self.node_id, role="prefill", replicas=[self.worker.stats()],
                                transfers=pb.TransferTotals(done=self.worker.done))


async def main(config: NodeConfig, served: str) -> int:
    worker = await VllmWorker.start(config, node_runtime.transfer_host(config))
    state = node_runtime.Lifecycle()

    def add(server: object, metrics: NodeMetrics) -> None:
        pb_grpc.add_PrefillServiceServicer_to_server(VllmPrefillService(worker, config.node_id, state, metrics),
                                                     server)

    return await node_runtime.serve(config, worker, served, add, state)
