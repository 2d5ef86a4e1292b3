"""The proxy's FastAPI application, assembled from its parts.

``create_app(config, tokenizer, nodes, max_model_len=...)`` takes the node source as a
dependency: ``python -m proxy`` passes the Redis registry, tests a ``StaticNodeSource``.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` (``api.responses_api``), ``/v1/models``
and ``/v1/models/{id}``, ``/tokenize``,
``/detokenize`` (API key when set), ``/health`` and ``/ping`` (vLLM's, GET or POST), ``/metrics`` (GET or
HEAD, as ``/health``), ``/version``, ``/admin/*`` (admin key when set). Anything else is a 404 in OpenAI's
shape, which names the OpenAI endpoints this model does not serve (``proxy.errors.not_found``).
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from cluster.config import ProxyConfig
from engine.tokenizer import Tokenizer
from proxy.admin import admin_router
from proxy.api.hot_path import GenerationEndpoints, ProxyApp
from proxy.api.ratelimit import RateLimiter
from proxy.api.serving import Serving
from proxy.errors import APIError, install_error_handlers, model_not_found
from proxy.link.clients import NodeClients
from proxy.metrics import FLUSH_S, ProxyMetrics, RequestCounter
from proxy.pipeline import Pipeline
from proxy.routing.breaker import STATE_VALUE, Breakers, Prober
from proxy.routing.discovery import NodeSource, NodeView, available, context_limit
from proxy.routing.kv_events import follow_kv_events
from proxy.routing.router import Router

log = logging.getLogger(__name__)
try:
    PDCLUSTER_VERSION = importlib.metadata.version("pdcluster")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was not installed
    PDCLUSTER_VERSION = "unknown"

_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/health", "/metrics",
              "/admin/nodes", "/admin/route", "/tokenize", "/detokenize", "/ping", "/version")


def model_limits(model_dir: str) -> tuple[int, int | None]:
    """The model's context limit (``max_position_embeddings``) and vocabulary size from its ``config.json``."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = raw.get("vocab_size")
    return int(raw.get("max_position_embeddings", 4096)), int(vocab) if vocab else None


def served_model_name(config: ProxyConfig) -> str:
    """The name clients pass as "model": as configured, else the model directory's name."""
    return config.served_model_name or Path(config.model).name


@dataclass
class ProxyState:
    """Everything one app instance owns (reachable as ``app.state.proxy``, e.g. from tests)."""

    config: ProxyConfig
    model_name: str
    view: NodeView
    router: Router
    clients: NodeClients
    pipeline: Pipeline
    metrics: ProxyMetrics
    serving: Serving


def bearer_guard(key: str | None) -> Callable[[Request], Awaitable[None]]:
    """A dependency that requires ``Authorization: Bearer <key>`` (no check when ``key`` is None)."""

    async def check(request: Request) -> None:
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken must not tell how much of a guessed key was right.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key", cause="auth")

    return check


def create_app(config: ProxyConfig, tokenizer: Tokenizer, nodes: NodeSource, *, max_model_len: int,
               vocab_size: int | None = None, on_shutdown: Callable[[], None] | None = None) -> ProxyApp:
    """The proxy app. ``max_model_len`` is the model's context limit, used until nodes publish theirs;
    ``vocab_size`` (the model's) bounds the token ids a prompt may carry (None: not checked here);
    ``on_shutdown`` runs when the server stops (after the last cleanup calls to the nodes)."""
    name = served_model_name(config)
    metrics = ProxyMetrics(name)
    breakers = Breakers(config.circuit_failures,
                        on_change=lambda node_id, state: metrics.circuit.labels(node_id).set(STATE_VALUE[state]))
    view = NodeView(nodes, hold_s=max(5.0, 10 * config.refresh_s), breakers=breakers)
    router = Router(name, local_prefill_max_tokens=config.local_prefill_max_tokens,
                    local_prefill_fallback=config.local_prefill_fallback)
    clients = NodeClients()
    prober = Prober(breakers, view.source_nodes, clients.channel, lambda: view.registry_error() is not None)
    pipeline = Pipeline(clients, router, metrics, config.prefill_timeout_s, config.token_timeout_s, view)
    handlers = Serving(model_name=name, tokenizer=tokenizer, view=view, pipeline=pipeline, metrics=metrics,
                       max_model_len=max_model_len, vocab_size=vocab_size, max_inflight=config.max_inflight_requests)
    state = ProxyState(config, name, view, router, clients, pipeline, metrics, handlers)
    created = int(time.time())

    async def watch_nodes() -> None:
        """The health probes, the registry's state in /metrics, and the prefix index's departed nodes,
        every ``health_probe_s``."""
        while True:
            metrics.registry_up.set(0 if view.registry_error() else 1)
            pipeline.legs.prefixes.forget({n.info.node_id for n in view.source_nodes()})
            try:
                await prober.probe_once()
            except Exception:  # must outlive anything one round does
                log.exception("node health probe failed")
            await asyncio.sleep(config.health_probe_s)

    def kv_capacity(node_id: str) -> int | None:
        return next((n.info.num_blocks for n in view.source_nodes() if n.info.node_id == node_id), None)

    async def flush_metrics() -> None:
        """The request path's tallies into their series, for the other workers' /metrics pages."""
        while True:
            await asyncio.sleep(FLUSH_S)
            try:
                metrics.flush()
            except Exception:  # must outlive one failed flush (the next one tries again)
                log.exception("flushing the metrics failed")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        probing = asyncio.ensure_future(watch_nodes())
        flushing = asyncio.ensure_future(flush_metrics())
        following = asyncio.ensure_future(follow_kv_events(view.kv_event_stream, pipeline.legs.prefixes, kv_capacity,
                                                           metrics.kv_events.inc))
        try:
            yield
        finally:
            probing.cancel()
            following.cancel()
            flushing.cancel()
            await asyncio.gather(probing, following, flushing, return_exceptions=True)
            try:
                await pipeline.drain_background()  # aborts sent on the way out still reach the nodes
                await clients.close()
            finally:
                metrics.flush()  # the last requests' tallies, for the other workers' pages
            if on_shutdown is not None:
                on_shutdown()

    app = ProxyApp(title="pdcluster proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = state
    install_error_handlers(app, lambda cause: metrics.errors.labels(cause).inc())
    app.add_middleware(RequestCounter, metrics=metrics, endpoint_of=_endpoint_label)
    api_guard = bearer_guard(config.api_key)
    limiter = (RateLimiter(config.rate_limit_rps, config.rate_limit_burst or max(1, math.ceil(config.rate_limit_rps)))
               if config.rate_limit_rps else None)
    app.hot = GenerationEndpoints({"/v1/completions": handlers.completions, "/v1/chat/completions": handlers.chat},
                                  api_guard, metrics, _endpoint_label, limiter, keyed=config.api_key is not None)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(api_guard)])
    v1.add_api_route("/completions", handlers.completions, methods=["POST"], response_model=None)
    v1.add_api_route("/chat/completions", handlers.chat, methods=["POST"], response_model=None)
    v1.add_api_route("/responses", handlers.responses, methods=["POST"], response_model=None)

    @v1.get("/responses/{response_id}")
    async def stored_response(response_id: str) -> None:
        raise APIError(404, f"no response {response_id!r}: this server does not store responses", param="response_id",
                       code="not_found")

    def model_card() -> dict[str, Any]:
        limit = context_limit(view.snapshot(), name, max_model_len)
        return {"id": name, "object": "model", "created": created, "owned_by": "pdcluster", "max_model_len": limit}

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:  # the openai client's models.retrieve
        if model_id != name:
            raise model_not_found(model_id)
        return model_card()

    @app.api_route("/health", methods=["GET", "HEAD"], response_model=None)
    async def health() -> JSONResponse:
        snapshot = view.snapshot()
        counts = {role: len(available(snapshot, name, role)) for role in ("prefill", "decode")}
        # without prefill nodes the decode nodes that prefill locally serve alone (a colocated cluster)
        local = config.local_prefill_fallback and any(n.info.local_prefill for n in available(snapshot, name, "decode"))
        registry = view.registry_state()
        if counts["decode"] and (counts["prefill"] or local):
            return JSONResponse({"status": "ok", "model": name, **counts, "local_prefill": local, **registry})
        missing = [role for role, n in counts.items() if n == 0]
        err = APIError(503, f"no healthy, non-draining {' or '.join(missing)} node for model {name!r}",
                       code=f"no_{missing[0]}_node")
        return JSONResponse({**err.body(), **counts, **registry}, status_code=503)

    @app.api_route("/ping", methods=["GET", "POST"], response_model=None)
    async def ping() -> JSONResponse:  # vLLM's (SageMaker's) liveness route: /health's answer
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": PDCLUSTER_VERSION}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics_page() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # vLLM's tokenizer endpoints (at the root, as vLLM serves them), behind the API key
    app.add_api_route("/tokenize", handlers.tokenize, methods=["POST"], response_model=None,
                      dependencies=[Depends(api_guard)])
    app.add_api_route("/detokenize", handlers.detokenize, methods=["POST"], response_model=None,
                      dependencies=[Depends(api_guard)])
    app.include_router(v1)
    app.include_router(admin_router(view, router, bearer_guard(config.admin_key), tokenizer.encode,
                                    pipeline.expected_cached))
    return app


def _endpoint_label(path: str) -> str:
    if path in _ENDPOINTS:
        return path
    if path.startswith("/admin/nodes/"):
        return "/admin/nodes/{node_id}"
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"
