"""What tests ask of a decode node's worker (``decode_node.worker.DecodeWorker``) without the gRPC service:
one request's events, read off its stream as the service would, into its tokens."""

from __future__ import annotations

import asyncio
from typing import Any


async def decoded(worker: Any, job: Any, dp_rank: int, timeout_s: float = 60.0) -> tuple[list[int], list[float]]:
    """Submit ``job`` to replica ``dp_rank`` (-1: the worker's choice) and read its stream to the end: the token
    ids and logprobs of its ``Tokens`` events (the first token, sampled on a prefill node, is the caller's).
    The exception that ended the request, if one did, is raised."""
    events: asyncio.Queue = asyncio.Queue()
    worker.submit(job, dp_rank, asyncio.get_running_loop(), events.put_nowait)
    ids: list[int] = []
    lps: list[float] = []
    while True:
        item = await asyncio.wait_for(events.get(), timeout_s)
        if item is None:
            return ids, lps
        if isinstance(item, BaseException):
            raise item
        if item.HasField("tokens"):
            ids += [t.token_id for t in item.tokens.tokens]
            lps += [t.logprob for t in item.tokens.tokens]
