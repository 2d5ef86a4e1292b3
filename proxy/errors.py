"""Errors in OpenAI's JSON shape: one exception type, the mapping of gRPC failures, the handlers.

Every error the proxy answers, from bad input to a node that died, has the body
``{"error": {"message", "type", "param", "code"}}``; FastAPI's own 422 and HTML/plain errors are
replaced so clients never see another shape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error answered to the client; ``cause`` labels it in the errors metric."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        cause: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s  # answered as a Retry-After header (overload: come back later)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or (INVALID_REQUEST if status < 500 else SERVER_ERROR)
        self.cause = cause or code or ("bad_request" if status < 500 else "internal")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s is not None else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code, cause="bad_request")


def validation_error(errors: list[Any]) -> APIError:
    """A 400 from pydantic's error list (``ValidationError.errors()``), naming the first bad field."""
    parts: dict[str, str] = {}  # one message per field: a union reports each member's complaint
    for e in errors:
        loc = ".".join(str(p) for p in e.get("loc", ()) if not _is_union_tag(p))
        parts.setdefault(loc, str(e.get("msg", "invalid")))
    message = "; ".join(f"{loc}: {msg}" if loc else msg for loc, msg in parts.items())
    param = next((loc for loc in parts if loc), None)
    return bad_request(message or "invalid request", param=param)


def _is_union_tag(part: Any) -> bool:
    """Whether a pydantic error location element is not a field but a union member ("list[int]")."""
    return part == "body" or (isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool")))


# gRPC status -> (HTTP status, error code). A full node asks the client to come back later (503,
# which OpenAI clients retry); a node that is down, draining or too slow is also 503; anything
# else a node answers unexpectedly is a bad gateway.
_RPC_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (503, "overloaded"),
    grpc.StatusCode.UNAVAILABLE: (503, "node_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (503, "timeout"),
    grpc.StatusCode.CANCELLED: (503, "node_unavailable"),
    # The decode node could not pull the KV from the prefill node (a source died, timed out, or its
    # lease ran out): the request can be sent again.
    grpc.StatusCode.FAILED_PRECONDITION: (503, "kv_transfer_failed"),
}


def rpc_error(phase: str, err: grpc.aio.AioRpcError) -> APIError:
    """The client's error for a failed gRPC call of ``phase`` ("prefill" or "decode")."""
    status, code = _RPC_STATUS.get(err.code(), (502, "node_error"))
    details = err.details() or err.code().name
    message = details if status == 400 else f"{phase} failed: {err.code().name}: {details}"
    retry = 1 if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else None  # full: worth trying again soon
    return APIError(status, message, code=code, cause=f"{phase}_{code}", retry_after_s=retry)


def error_for(exc: Exception, count: Callable[[str], None]) -> JSONResponse:
    """The OpenAI-shaped answer to an exception a handler raised (``count(cause)`` for the errors
    metric); anything unexpected is logged and answered as a 500."""
    if isinstance(exc, APIError):
        count(exc.cause)
        return error_response(exc)
    if isinstance(exc, (RequestValidationError, ValidationError)):
        count("bad_request")
        return error_response(validation_error(list(exc.errors())))
    if isinstance(exc, StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
        err = APIError(exc.status_code, str(exc.detail), code=code)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)
    count("internal")
    log.error("unexpected error", exc_info=exc)
    return error_response(APIError(500, "internal server error", code="internal_error"))


# OpenAI's (and vLLM's) endpoints a chat / completions model does not serve here, by their first path part
# under /v1 (or at the root, vLLM's): what a 404 for them names.
_UNSERVED = {"embeddings": "embeddings", "audio": "audio", "images": "images", "moderations": "moderations",
             "files": "files", "fine_tuning": "fine-tuning jobs", "batches": "batches", "assistants": "assistants",
             "threads": "threads", "vector_stores": "vector stores", "uploads": "uploads",
             "realtime": "realtime sessions",
             "rerank": "reranking", "score": "scoring", "pooling": "pooling", "classify": "classification"}


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def not_found(path: str) -> APIError:
    """The 404 for ``path``: which OpenAI endpoint this server does not serve, or which path it does not know."""
    part = path.removeprefix("/v1").strip("/").split("/")[0]
    if part in _UNSERVED:
        return APIError(404, f"{path}: this server does not serve {_UNSERVED[part]}; its model serves "
                             "/v1/completions and /v1/chat/completions", code="unsupported_endpoint")
    return APIError(404, f"{path} is not an endpoint of this server", code="not_found")


def install_error_handlers(app: FastAPI, count: Callable[[str], None] = lambda cause: None) -> None:
    """Make every error the app answers an OpenAI error body (never a 422, never HTML);
    ``count(cause)`` is called for each (the errors metric)."""

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        if not isinstance(exc, (APIError, RequestValidationError, ValidationError, StarletteHTTPException)):
            log.error("unexpected error on %s %s", request.method, request.url.path)
        if isinstance(exc, StarletteHTTPException) and exc.status_code == 404 and exc.detail == "Not Found":
            exc = not_found(request.url.path)  # no route (a handler's own 404s say more already)
        return error_for(exc, count)

    for kind in (APIError, RequestValidationError, ValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, on_error)
