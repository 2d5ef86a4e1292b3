"""One request's trip through the cluster: route, prefill, then the decode stream.

``Pipeline`` routes and runs the prefill leg; ``Generation`` runs the decode leg and hands out the
tokens. Both use one ``Legs`` (node clients, the routing view, metrics, timeouts, background
cleanup); neither reaches into the other.

Lifecycle (every exit path goes through ``Generation.close``, which is idempotent):

1. ``Pipeline.start``: route, count the request on the chosen replicas (``LocalLoad``), call
   ``Prefill`` with a deadline. On failure or cancellation: ``Abort`` on the prefill node (it may
   have finished and hold the KV), uncount, raise ``APIError`` -- except that an UNAVAILABLE
   prefill node (dead, or stopping before the registry says so) gets the request retried once
   on another replica.
2. If the first token already finished the request, there is no decode leg and nothing is held
   on the prefill node. Otherwise the ``Decode`` stream is opened at once, so the KV transfer
   overlaps with sending the first token to the client.
3. ``Generation.next_tokens`` returns the first token, then each ``tokens`` event; the
   ``admitted`` event (the decode side has the KV and released it on the prefill node) is
   recorded in metrics. Each wait is bounded by ``token_timeout_s``.
4. ``Generation.close``: if the decode node did not finish the request itself (failure, client
   gone, stop string found by the proxy), cancel the Decode stream (which aborts the request on
   the decode node) and ``Abort`` on the prefill node, in the background.

A node that refuses a connection (UNAVAILABLE) opens its circuit breaker at once (``routing.breaker``),
so new requests avoid it before its registry heartbeat expires, until a health probe finds it
serving; other faults of a node (deadlines, internal errors, a stalled stream) open it after a few
in a row. A decode node that fails that way
before sending anything, or that has no room for the request (RESOURCE_EXHAUSTED: its blocks went
to requests its last heartbeat did not show yet), gets the decode leg moved to another decode rank
once; the prefill node still holds the KV under its lease, so nothing is lost. A full node stays
in the view: only this request avoids that rank.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import grpc

from cluster.nodes import NodeState
from cluster.proto_gen import pdcluster_v1_pb2 as pb
from engine.block_hash import prompt_block_hashes
from proxy.errors import APIError, rpc_error
from proxy.link import mux_client
from proxy.link.clients import NodeClients
from proxy.metrics import ProxyMetrics
from proxy.routing.discovery import NodeView
from proxy.routing.prefix_index import PrefixIndex
from proxy.routing.router import CachedTokens, LocalLoad, NoRoute, Route, Router

log = logging.getLogger(__name__)

PREFILL_ATTEMPTS = 2  # one retry on another replica when a prefill node is UNAVAILABLE
DECODE_ATTEMPTS = 2  # one retry on another decode rank when a decode node fails before any event
# Decode failures before any event that move the decode leg to another rank.
MOVABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
# Failures that say the node itself is unwell (they count towards opening its circuit breaker).
NODE_FAULTS = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
               grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNIMPLEMENTED)


@dataclass(slots=True)  # not frozen: made per request, and a frozen __init__ costs 5x
class GenerationRequest:
    """A validated, tokenized request, ready to route."""

    request_id: str
    endpoint: str  # "completions" | "chat": metrics label
    prompt_token_ids: list[int]
    sampling: pb.SamplingParams
    arrival: float  # time.perf_counter() when the HTTP request arrived


class _Counted:
    """This request's share of ``LocalLoad``, given back part by part as the request moves on."""

    def __init__(self, load: LocalLoad, route: Route, prompt_tokens: int, blocks: int) -> None:
        self._load, self._route = load, route
        self._tokens, self._blocks = prompt_tokens, blocks
        p, d = route.prefill, route.decode
        if p is not None:  # a local prefill loads only its decode rank
            load.add(p.node_id, p.dp_rank, tokens=prompt_tokens, requests=1)
        load.add(d.node_id, d.dp_rank, seqs=1, blocks=blocks, requests=1)
        self._prefill_tokens = self._prefill_request = p is not None
        self._decode = True

    def prefill_answered(self) -> None:
        p = self._route.prefill
        if self._prefill_tokens and p is not None:
            self._prefill_tokens = False
            self._load.remove(p.node_id, p.dp_rank, tokens=self._tokens)

    def prefill_released(self) -> None:
        """The prefill node holds nothing for the request any more."""
        self.prefill_answered()
        p = self._route.prefill
        if self._prefill_request and p is not None:
            self._prefill_request = False
            self._load.remove(p.node_id, p.dp_rank, requests=1)

    def move_decode(self, route: Route) -> None:
        """The decode leg moved to ``route.decode``."""
        if self._decode:
            d = self._route.decode
            self._load.remove(d.node_id, d.dp_rank, seqs=1, blocks=self._blocks, requests=1)
            self._load.add(route.decode.node_id, route.decode.dp_rank, seqs=1, blocks=self._blocks, requests=1)
        self._route = route

    def release(self) -> None:
        self.prefill_released()
        if self._decode:
            self._decode = False
            self._load.remove(self._route.decode.node_id, self._route.decode.dp_rank, seqs=1, blocks=self._blocks,
                              requests=1)


class Legs:
    """What both legs of every request use: the node clients, the routing view, metrics, timeouts,
    and the background cleanup calls (so none is lost or left running)."""

    def __init__(self, clients: NodeClients, router: Router, metrics: ProxyMetrics, prefill_timeout_s: float,
                 token_timeout_s: float, view: NodeView | None = None) -> None:
        self.view = view
        self.clients = clients
        self.router = router
        self.metrics = metrics
        self.prefill_timeout_s = prefill_timeout_s
        self.token_timeout_s = token_timeout_s
        self.prefixes = PrefixIndex()  # where prompts' prefixes are probably cached (prefix caching)
        self._background: set[asyncio.Task[Any]] = set()

    def node_failed(self, node_id: str, code: grpc.StatusCode | None) -> None:
        """A call to the node failed with ``code`` (None: it stalled past its timeout): a refused
        connection opens its circuit breaker at once, a fault of the node counts towards opening it;
        a full node or a bad request is no fault of the node."""
        if self.view is None:
            return
        if code == grpc.StatusCode.UNAVAILABLE:
            self.view.mark_unreachable(node_id)
        elif code is None or code in NODE_FAULTS:
            self.view.breakers.failure(node_id)

    def node_ok(self, node_id: str) -> None:
        if self.view is not None:
            self.view.breakers.success(node_id)

    def other_decode(self, req: GenerationRequest, route: Route, whole_node: bool) -> Route | None:
        """Another decode rank for a request its decode rank failed before any event (None if there
        is none): on another node when ``whole_node`` (it is unreachable), else on another rank."""
        if self.view is None:
            return None
        failed = (route.decode.node_id, route.decode.dp_rank)
        # a local prefill moves to another rank that prefills locally
        source = route.prefill.node_id if route.prefill is not None else None
        plan = self.router.plan(self.view.snapshot(), len(req.prompt_token_ids), req.sampling.max_tokens,
                                prefill_node=source, exclude_decode=[failed], local=True if source is None else None)
        if plan.decode is None or (whole_node and plan.decode.node_id == route.decode.node_id):
            return None
        self.metrics.add(self.metrics.routing, ("decode", plan.decode.node_id))
        return Route(route.prefill, plan.decode)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a cleanup call in the background (it must not wait on, or die with, the request)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain_background(self, timeout_s: float = 5.0) -> None:
        """Let pending cleanup calls finish (at shutdown)."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout_s)


class Pipeline:
    """Starts generations: routes each request and runs its prefill leg; ``Generation`` runs the rest."""

    def __init__(self, clients: NodeClients, router: Router, metrics: ProxyMetrics, prefill_timeout_s: float,
                 token_timeout_s: float, view: NodeView | None = None) -> None:
        self.legs = Legs(clients, router, metrics, prefill_timeout_s, token_timeout_s, view)

    async def start(self, req: GenerationRequest, nodes: list[NodeState]) -> Generation:
        """Route and prefill; raises ``APIError`` (nothing is left held when it does).

        A prefill node that answers UNAVAILABLE (dead, or draining/stopping before the registry
        says so) costs the client nothing: the request is tried once more on another replica.
        """
        legs = self.legs
        failed: list[str] = []
        last_error: grpc.aio.AioRpcError | None = None
        prefix = _PromptPrefix(legs.prefixes, nodes, req.prompt_token_ids)
        while True:
            try:
                # prompt logprobs (echo) come from a prefill node's answer: never a local prefill then
                route = legs.router.route(nodes, len(req.prompt_token_ids), req.sampling.max_tokens, failed,
                                          local=False if req.sampling.HasField("prompt_logprobs") else None,
                                          cached=prefix.cached_tokens if prefix.useful else None)
            except NoRoute as e:
                if last_error is not None:  # no other replica to retry on: the node's error it is
                    raise rpc_error("prefill", last_error) from None
                raise APIError(503, e.message, code=e.code, cause="no_route") from None
            if route.prefill is None:  # the decode rank prefills: its stream brings the first token
                legs.metrics.add(legs.metrics.routing, ("prefill", "local"))
                legs.metrics.add(legs.metrics.routing, ("decode", route.decode.node_id))
                legs.metrics.add(legs.metrics.prompt_tokens, amount=len(req.prompt_token_ids))
                counted = _Counted(legs.router.load, route, len(req.prompt_token_ids), route.decode.needed_blocks)
                return Generation(legs, req, route, None, counted, prefix)
            prefill_route = route.prefill
            try:
                reply, counted, sent = await self._prefill(req, route)
            except grpc.aio.AioRpcError as e:
                legs.node_failed(prefill_route.node_id, e.code())
                if e.code() not in MOVABLE or len(failed) + 1 >= PREFILL_ATTEMPTS:
                    raise rpc_error("prefill", e) from None
                log.warning("prefill of %s on %s %s (%s); trying another replica", req.request_id,
                            prefill_route.node_id, e.code().name, e.details())
                failed.append(prefill_route.node_id)
                last_error = e
                continue
            legs.node_ok(prefill_route.node_id)
            prefix.prefilled(prefill_route.node_id, prefill_route.dp_rank)
            legs.metrics.add(legs.metrics.cached_tokens, ("prefill",), reply.cached_tokens)
            legs.metrics.observe(legs.metrics.ttft, time.perf_counter() - req.arrival, (req.endpoint,))
            return Generation(legs, req, route, reply, counted, prefix, prompt_ids=sent.token_ids)

    async def _prefill(self, req: GenerationRequest,
                       route: Route) -> tuple[pb.PrefillResponse, _Counted, pb.PrefillRequest]:
        """The prefill call: its answer, the request's share of the load, and the call as sent."""
        legs = self.legs
        n = len(req.prompt_token_ids)
        assert route.prefill is not None
        legs.metrics.add(legs.metrics.routing, ("prefill", route.prefill.node_id))
        legs.metrics.add(legs.metrics.routing, ("decode", route.decode.node_id))
        legs.metrics.add(legs.metrics.prompt_tokens, amount=n)
        counted = _Counted(legs.router.load, route, n, route.decode.needed_blocks)
        prefill = pb.PrefillRequest(request_id=req.request_id, token_ids=req.prompt_token_ids, sampling=req.sampling,
                                    dp_rank=route.prefill.dp_rank)
        t0 = time.perf_counter()
        try:
            reply = await mux_client.prefill(legs.clients.prefill_stream(route.prefill.address), prefill,
                                             legs.prefill_timeout_s)
            legs.metrics.observe(legs.metrics.prefill_rpc_s, time.perf_counter() - t0)
            legs.metrics.observe(legs.metrics.prefill_queue_s, reply.queue_s)
            legs.metrics.observe(legs.metrics.prefill_s, reply.prefill_s)
        except BaseException:  # an RPC error, or cancelled because the client left
            # The node may have finished the prefill and hold the KV: free it there.
            legs.spawn(legs.clients.abort_prefill(route.prefill.address, req.request_id))
            counted.release()
            raise
        counted.prefill_answered()
        return reply, counted, prefill

    async def drain_background(self, timeout_s: float = 5.0) -> None:
        """Let pending cleanup calls finish (at shutdown)."""
        await self.legs.drain_background(timeout_s)

    def expected_cached(self, nodes: list[NodeState], prompt: list[int]) -> CachedTokens | None:
        """(node id, DP rank) -> the prompt's tokens expected in that replica's prefix cache (what
        routing uses; None when no node caches prefixes)."""
        prefix = _PromptPrefix(self.legs.prefixes, nodes, prompt)
        return prefix.cached_tokens if prefix.useful else None


class _PromptPrefix:
    """One prompt's view of the prefix index: its block hashes (per block size; computed only when
    some node caches prefixes), the tokens expected cached on a prefill replica or decode rank, and
    the record of where its KV went (a prefill replica's cache keeps the prompt; a decode rank's keeps
    the prompt and the answer it computed, which the conversation's next turn starts with)."""

    def __init__(self, index: PrefixIndex, nodes: list[NodeState], prompt: list[int]) -> None:
        self._index = index
        self._prompt = prompt
        self._info = {n.info.node_id: n.info for n in nodes if n.info.prefix_caching}
        self._hashes: dict[int, list[int]] = {}
        self.useful = bool(self._info)

    def _of(self, block_size: int) -> list[int]:
        h = self._hashes.get(block_size)
        if h is None:
            h = self._hashes[block_size] = PrefixIndex.hashes(self._prompt, block_size)
        return h

    def caches(self, node_id: str) -> bool:
        return node_id in self._info

    def cached_tokens(self, node_id: str, dp_rank: int) -> int:
        info = self._info.get(node_id)
        if info is None:
            return 0
        return self._index.expected_hit(node_id, dp_rank, self._of(info.block_size)) * info.block_size

    def prefilled(self, node_id: str, dp_rank: int) -> None:
        info = self._info.get(node_id)
        if info is not None:
            self._index.record(node_id, dp_rank, self._of(info.block_size), capacity=info.num_blocks)

    def decoded(self, node_id: str, dp_rank: int, outputs: list[int]) -> None:
        """The decode rank holds the prompt's KV and that of ``outputs`` but the last (never fed back)."""
        info = self._info.get(node_id)
        if info is None:
            return
        hashes = (prompt_block_hashes(self._prompt + outputs[:-1], info.block_size) if len(outputs) > 1
                  else self._of(info.block_size))
        self._index.record(node_id, dp_rank, hashes, capacity=info.num_blocks)


class GenerationError(Exception):
    """The decode leg failed after the response may have started; carries the client's error."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


class Generation:
    """A prefilled request: its first token, then the decode node's tokens. Without a prefill ``reply``
    (a local prefill on the decode rank) every token, the first too, comes from the decode stream."""

    def __init__(self, legs: Legs, req: GenerationRequest, route: Route, reply: pb.PrefillResponse | None,
                 counted: _Counted, prefix: _PromptPrefix | None = None, prompt_ids: Any = None) -> None:
        """``prompt_ids``: the prompt as the prefill call carried it (a protobuf repeated field), which the
        decode call copies in C (building it again from the list of ints took ~8 us a 512-token prompt)."""
        self._legs = legs
        self.request = req
        self.route = route
        self._prefix = prefix
        self._outputs: list[int] = [] if reply is None else [reply.first_token.token_id]  # for the prefix record
        self._reply = reply
        self._prompt_ids = req.prompt_token_ids if prompt_ids is None else prompt_ids
        self._counted = counted
        self._first_taken = reply is None  # nothing to hand out before the stream's tokens
        self._ttft_pending = reply is None  # observed at the stream's first token
        self._finished = reply is not None and bool(reply.finish_reason)  # the nodes ended it: nothing to abort
        self._closed = False
        # Set once the decode rank holds the prompt's KV (or nothing will come): a request's further
        # samples wait for it, so they find the prompt in both nodes' prefix caches (n > 1).
        self.admitted = asyncio.Event()
        if self._finished:
            self.admitted.set()
        self._last_token_at = time.perf_counter()
        self._call: mux_client.DecodeCall | None = None
        self._opened_at = time.perf_counter()
        self._first_event_seen = False
        self._events = 0  # decode events received
        self._decode_attempts = 1
        if self._finished:
            counted.prefill_released()
        else:
            self._open_decode()

    def _open_decode(self) -> None:
        req, reply = self.request, self._reply
        decode = pb.DecodeRequest(request_id=req.request_id, prompt_token_ids=self._prompt_ids,
                                  sampling=req.sampling, dp_rank=self.route.decode.dp_rank,
                                  first_token=reply.first_token if reply is not None else None,
                                  mtp_drafts=reply.mtp_drafts if reply is not None else None)
        if reply is None:
            decode.local_prefill = True
        elif reply.WhichOneof("kv_source") == "kv":
            decode.kv.CopyFrom(reply.kv)
        elif reply.WhichOneof("kv_source") == "vllm_kv_params_json":
            decode.vllm_kv_params_json = reply.vllm_kv_params_json
        self._call = mux_client.DecodeCall(self._legs.clients.decode_stream(self.route.decode.address), decode)
        self._opened_at = time.perf_counter()
        self._first_event_seen = False

    def ready(self) -> bool:
        """Whether ``next_tokens`` would answer without waiting."""
        return not self._first_taken or (self._call is not None and self._call.ready)

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def prompt_tokens(self) -> list[pb.Token]:
        """The prompt's tokens with their logprobs, when the prefill node was asked for them (echo)."""
        return list(self._reply.prompt_tokens) if self._reply is not None else []

    async def next_tokens(self) -> tuple[list[pb.Token], str]:
        """The next output tokens and the finish reason ("" until the last batch).

        Raises ``GenerationError`` when the decode node fails, stalls past ``token_timeout_s`` or
        ends its stream without a finish reason.
        """
        if not self._first_taken:
            self._first_taken = True
            self._legs.metrics.add(self._legs.metrics.generation_tokens)
            assert self._reply is not None
            return [self._reply.first_token], self._reply.finish_reason
        if self._finished or self._call is None:
            raise RuntimeError("the generation is already finished")
        while True:
            event = await self._read()
            kind = event.WhichOneof("event")
            if kind == "admitted":
                self.admitted.set()
                metrics = self._legs.metrics
                metrics.observe(metrics.decode_admission_s, time.perf_counter() - self._opened_at)
                metrics.observe(metrics.kv_transfer_s, event.admitted.transfer_s)
                metrics.add(metrics.kv_transfer_bytes, amount=event.admitted.transfer_bytes)
                metrics.add(metrics.cached_tokens, ("decode",), event.admitted.cached_tokens)
                self._counted.prefill_released()
                self._record_prefix()
            elif kind == "tokens" and (event.tokens.tokens or event.tokens.finish_reason):
                tokens = list(event.tokens.tokens)
                if not self._first_event_seen:
                    self._first_event_seen = True
                    self._legs.metrics.observe(self._legs.metrics.first_decode_token_s,
                                               time.perf_counter() - self._opened_at)
                gaps = len(tokens)  # tokens that end an inter-token gap
                if self._ttft_pending and tokens:  # a local prefill's first token: TTFT, not a gap
                    self._ttft_pending = False
                    metrics = self._legs.metrics
                    metrics.observe(metrics.ttft, time.perf_counter() - self.request.arrival, (self.request.endpoint,))
                    metrics.add(metrics.generation_tokens)
                    self._last_token_at = time.perf_counter()
                    gaps -= 1
                self._observe_tokens(gaps)
                if self._prefix is not None and self._prefix.caches(self.route.decode.node_id):
                    self._outputs.extend(t.token_id for t in tokens)
                if event.tokens.finish_reason:
                    self._finished = True
                    self._counted.prefill_released()
                    self._record_prefix()
                return tokens, event.tokens.finish_reason

    def _record_prefix(self) -> None:
        """The decode rank's prefix cache now holds the prompt (admitted) and the answer (finished)."""
        if self._prefix is not None:
            self._prefix.decoded(self.route.decode.node_id, self.route.decode.dp_rank, self._outputs)

    async def _read(self) -> pb.DecodeEvent:
        assert self._call is not None
        while True:
            # A local prefill's first token comes after its prefill (and its queue): the prefill's limit.
            limit = self._legs.prefill_timeout_s if self._ttft_pending else self._legs.token_timeout_s
            try:
                event = await self._call.read(limit)
                break
            except TimeoutError:
                self._legs.node_failed(self.route.decode.node_id, None)
                raise GenerationError(APIError(
                    503, f"decode timed out: no token for {limit:g}s", code="token_timeout",
                    cause="token_timeout")) from None
            except grpc.aio.AioRpcError as e:
                self._legs.node_failed(self.route.decode.node_id, e.code())
                if e.code() not in MOVABLE:
                    raise GenerationError(rpc_error("decode", e)) from None
                gone = e.code() == grpc.StatusCode.UNAVAILABLE
                movable = self._events == 0 and self._decode_attempts < DECODE_ATTEMPTS
                other = self._legs.other_decode(self.request, self.route, gone) if movable else None
                if other is None:
                    raise GenerationError(rpc_error("decode", e)) from None
                log.warning("decode of %s on %s rank %d failed (%s: %s); moving it to %s rank %d",
                            self.request.request_id, self.route.decode.node_id, self.route.decode.dp_rank,
                            e.code().name, e.details(), other.decode.node_id, other.decode.dp_rank)
                self._decode_attempts += 1
                self._counted.move_decode(other)
                self.route = other
                self._open_decode()
        if self._events == 0:
            self._legs.node_ok(self.route.decode.node_id)
        self._events += 1
        if event is grpc.aio.EOF:
            raise GenerationError(APIError(502, "decode stream ended without a finish reason", code="node_error",
                                           cause="decode_node_error"))
        return event

    def _observe_tokens(self, k: int) -> None:
        if k == 0:
            return
        now = time.perf_counter()
        gap = (now - self._last_token_at) / k  # tokens arrive in batches: spread the gap over them
        self._last_token_at = now
        metrics = self._legs.metrics
        metrics.observe(metrics.itl, gap, count=k)
        metrics.add(metrics.generation_tokens, amount=k)

    def close(self) -> None:
        """End the request; idempotent. Unless the nodes finished it, cancel decode and abort prefill."""
        if self._closed:
            return
        self._closed = True
        self.admitted.set()
        if not self._finished:
            if self._call is not None:
                self._call.cancel()
            if self.route.prefill is not None:
                self._legs.spawn(self._legs.clients.abort_prefill(self.route.prefill.address, self.request.request_id))
        self._counted.release()

