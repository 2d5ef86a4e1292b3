"""The generation endpoints as plain ASGI, in front of FastAPI's middleware and routing.

Through FastAPI, a request and each of its streamed events pass seven wrappers (error, telemetry
and body-limit middleware, the request counter, the exception middleware, the exit stack, the
router and its dependency solver). On null nodes that was a sixth of the proxy's CPU per request
(docs/benchmarks.md). Here ``POST /v1/completions`` and ``/v1/chat/completions`` go straight to
``Serving``'s handlers. They get the same API-key check, the same error answers
(``errors.error_for``) and the same request counter, and the rate limit (``ratelimit``). Every
other request goes to the FastAPI app (``ProxyApp``), whose routes for these two paths still answer
other methods (405).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from proxy.api.ratelimit import RateLimiter
from proxy.errors import APIError, error_for
from proxy.metrics import ProxyMetrics, RequestCounter

Handler = Callable[[Request], Awaitable[Response]]


class GenerationEndpoints:
    """``POST`` on the generation paths, served without the FastAPI stack."""

    def __init__(self, routes: dict[str, Handler], guard: Callable[[Request], Awaitable[None]],
                 metrics: ProxyMetrics, endpoint_of: Callable[[str], str], limiter: RateLimiter | None = None,
                 keyed: bool = False) -> None:
        self._routes = routes
        self._guard = guard
        self._limiter = limiter
        self._keyed = keyed  # callers are their API keys (checked by the guard), else their addresses
        self._count = lambda cause: metrics.errors.labels(cause).inc()
        self._counted = RequestCounter(self._serve, metrics=metrics, endpoint_of=endpoint_of)

    def handles(self, scope: Scope) -> bool:
        return scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self._routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._counted(scope, receive, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            await self._guard(request)
            if self._limiter is not None:
                self._check_rate(request)
            response = await self._routes[scope["path"]](request)
        except Exception as exc:  # as FastAPI's handlers would answer it (errors.install_error_handlers)
            response = error_for(exc, self._count)
        await response(scope, receive, send)


    def _check_rate(self, request: Request) -> None:
        assert self._limiter is not None
        if self._keyed:
            key = "key:" + request.headers.get("authorization", "")
        else:  # a header anyone can vary says nothing about who calls
            key = "addr:" + (request.client.host if request.client else "")
        wait = self._limiter.take(key)
        if wait > 0:
            raise APIError(429, f"Rate limit reached: {self._limiter.rate:g} requests per second (burst "
                                f"{self._limiter.burst}); try again in {wait:.2f}s", type="requests",
                           code="rate_limit_exceeded", cause="rate_limited", retry_after_s=max(1, math.ceil(wait)))


class ProxyApp(FastAPI):
    """The FastAPI app, with the generation endpoints (``hot``) served ahead of its stack."""

    hot: GenerationEndpoints | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.hot is not None and self.hot.handles(scope):
            scope["app"] = self
            await self.hot(scope, receive, send)
            return
        await super().__call__(scope, receive, send)
