"""``python -m decode_node --engine vllm``: ``DecodeService`` over a vLLM engine (``kv_consumer``).

Decode = vLLM generate with the prompt *plus the first token the prefill node sampled* (the client
has it already) and ``kv_transfer_params`` whose ``remote_num_tokens`` is the prompt's length: the
connector loads the prompt's KV, vLLM computes the first token's KV itself and samples token 2, so
the stream continues from exactly the token the client got, for any sampling (vLLM's own P/D
convention, which re-samples the first token on the decode side, could diverge from it). vLLM
gets ``max_tokens - 1`` and ``min_tokens - 1``. Admitted is sent with the first output (the KV
has arrived by then). A cancelled stream aborts in vLLM.

The params come from a vLLM prefill node (``DecodeRequest.vllm_kv_params_json``) or are built from
a native prefill node's ``KVHandle`` (``vllm_backend.handle_params``). In the second case the
node releases the request on the prefill node (``Release``, as native decode nodes confirm) at the
first output, when the KV has been read; ``found=False`` means the prefill node's lease ran out
first, and the request fails with FAILED_PRECONDITION, as on native nodes. A stream that ends
before that releases nothing: the proxy may move the decode leg to another node with the same
handle (and aborts the prefill when it gives up); the lease frees the blocks otherwise.
Imported only with ``--engine vllm``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

import grpc

from cluster.config import NodeConfig
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from cluster.proto_gen import pdcluster_v1_pb2_grpc as pb_grpc
from kv_transfer.handle import from_handle
from kv_transfer.handoff import KVLost
from node_runtime import server as node_runtime
from node_runtime.confirm import PrefillConfirmer
from node_runtime.metrics import NodeMetrics
from node_runtime.mux_server import DecodeEventsMux
from vllm_backend import handle_params
from vllm_backend.engine import VllmWorker, finish_reason, sampling_to_vllm, tokens_pb

log = logging.getLogger("pdcluster.decode")


def _drop(item: object) -> None:
    """The metrics' sink of a call whose events are yielded, not sent."""


class VllmDecodeService(DecodeEventsMux, pb_grpc.DecodeServiceServicer):
    def __init__(self, worker: VllmWorker, node_id: str, state: node_runtime.Lifecycle,
                 confirm: PrefillConfirmer, metrics: NodeMetrics) -> None:
        self.worker = worker
        self.node_id = node_id
        self.state = state
        self.confirm = confirm
        self.metrics = metrics

    async def Decode(
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeEvent]:
        rid = request.request_id
        refused = self.worker.refusal(rid, "prompt_token_ids", bool(request.prompt_token_ids), request.dp_rank,
                                      self.state.stopping)
        if refused is not None:
            await context.abort(*refused)
        release_to = ""  # a native prefill node's address, until the request is released there
        n = len(request.prompt_token_ids)
        try:
            if request.sampling.max_tokens < 2:
                raise ValueError("max_tokens < 2: the prefill node's first token is the whole answer")
            if not request.HasField("first_token"):
                raise ValueError("first_token (the prefill node's) is required")
            if request.vllm_kv_params_json:
                kv = json.loads(request.vllm_kv_params_json)
                if not isinstance(kv, dict):
                    raise ValueError("vllm_kv_params_json must be a JSON object")
            elif request.HasField("kv"):
                source = from_handle(request.kv, self.worker.kv_cache_dtype)  # a bad handle is the caller's error
                kv = handle_params.handle_params(request.kv, rid, n)
                if source.request.num_blocks * source.block_size < n:
                    raise ValueError(f"the KV handle holds {source.request.num_blocks} blocks of "
                                     f"{source.block_size}, fewer than the prompt's {n} tokens")
                release_to = request.kv.prefill_address
            else:
                raise ValueError("a KV handle (native prefill node) or vllm_kv_params_json (vLLM prefill node) "
                                 "is required")
            kv["remote_num_tokens"] = n  # load the prompt; the first token is computed here
            params = sampling_to_vllm(request.sampling, kv, max_tokens=request.sampling.max_tokens - 1,
                                      min_tokens=max(0, request.sampling.min_tokens - 1), first_output_in_prompt=True)
        except ValueError as e:  # json.JSONDecodeError included
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        prompt = {"prompt_token_ids": [*request.prompt_token_ids, request.first_token.token_id]}
        t0 = time.perf_counter()
        observe = self.metrics.decode_call(n, _drop)  # the events' times and tokens, as they are yielded
        self.worker.begin(rid, n + request.sampling.max_tokens)
        seen = 0  # output tokens so far
        try:
            async for out in self.worker.engine.generate(prompt, params, rid):
                if seen == 0 and release_to:
                    address, release_to = release_to, ""
                    if not await asyncio.to_thread(self.confirm, address, rid):
                        raise KVLost(f"the prefill node no longer held {rid}'s KV when it was confirmed")
                if seen == 0:
                    self.worker.active[rid] = "running"
                    admitted = pb.DecodeEvent(admitted=pb.Admitted(dp_rank=0, transfer_s=time.perf_counter() - t0,
                                                                   cached_tokens=out.num_cached_tokens or 0))
                    observe(admitted)
                    yield admitted
                completion = out.outputs[0]
                tokens = tokens_pb(completion)
                seen += len(completion.token_ids)
                reason = finish_reason(completion) if out.finished else ""
                if out.finished and not reason:  # vLLM ended it: a failed KV load ends a request this way
                    raise RuntimeError(f"vLLM ended the request ({completion.finish_reason}); a failed KV "
                                       "load does this, and this node's log says why")
                if tokens or reason:
                    event = pb.DecodeEvent(tokens=pb.Tokens(tokens=tokens, finish_reason=reason))
                    observe(event)
                    yield event
            self.worker.done += 1
            observe(None)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except KVLost as e:
            await self.worker.abort(rid)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except Exception as e:
            self.worker.check()
            code = grpc.StatusCode.UNAVAILABLE if self.worker.failed.is_set() else grpc.StatusCode.ABORTED
            await context.abort(code, f"vLLM: {e}")
        finally:  # a cancelled stream: vLLM's generate aborts the request itself
            self.worker.end(rid)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(found=await self.worker.abort(request.request_id))

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        return pb.StatsResponse(node_id=self.node_id, role="decode", replicas=[self.worker.stats()],
                                transfers=self.worker.transfer_totals())


async def main(config: NodeConfig, served: str) -> int:
    worker = await VllmWorker.start(config, node_runtime.transfer_host(config))
    state = node_runtime.Lifecycle()
    confirm = PrefillConfirmer()

    def add(server: object, metrics: NodeMetrics) -> None:
        pb_grpc.add_DecodeServiceServicer_to_server(VllmDecodeService(worker, config.node_id, state, confirm, metrics),
                                                    server)

    try:
        return await node_runtime.serve(config, worker, served, add, state)
    finally:
        confirm.close()
