"""The admin API: list nodes, drain and undrain them, explain a routing decision.

``GET /admin/nodes`` (and the nodes that failed lately, with why), ``POST /admin/nodes/{node_id}/drain``
and ``/undrain``, ``GET /admin/route?prompt_tokens=N[&max_tokens=M]`` or ``?prompt=TEXT`` (tokenized as
is: the prefix caches' expected hits count then). Guarded by the admin key when one is set.
A drain takes effect on this proxy's very next request; requests in flight finish.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse

from cluster.nodes import NodeState
from proxy.errors import APIError
from proxy.routing.discovery import NodeView
from proxy.routing.router import CachedTokens, Router

log = logging.getLogger(__name__)


def admin_router(view: NodeView, router: Router, guard: Callable[..., Awaitable[None]],
                 tokenize: Callable[[str], list[int]] | None = None,
                 expected_cached: Callable[[list[NodeState], list[int]], CachedTokens | None] | None = None,
                 ) -> APIRouter:
    """``tokenize`` and ``expected_cached`` (the pipeline's) explain a route for a prompt's text."""
    api = APIRouter(prefix="/admin", dependencies=[Depends(guard)])

    @api.get("/nodes")
    async def nodes() -> dict[str, Any]:
        return {"nodes": [{**n.to_dict(), "inflight": router.load.requests(n.info.node_id),
                           "circuit": view.breakers.state(n.info.node_id)} for n in view.snapshot()],
                "failed": [f.to_dict() for f in await view.failures()], **view.registry_state()}

    async def set_draining(node_id: str, draining: bool) -> dict[str, Any]:
        try:
            found = await view.set_draining(node_id, draining)
        except Exception as e:  # the registry is down: say so rather than 500
            log.warning("setting draining=%s on %s failed: %s", draining, node_id, e)
            raise APIError(503, f"the registry is unavailable: {e}", code="registry_unavailable") from None
        if not found:
            raise APIError(404, f"no node {node_id!r} is registered", param="node_id", code="node_not_found")
        log.info("node %s %s", node_id, "draining" if draining else "undrained")
        return {"node_id": node_id, "draining": draining}

    @api.post("/nodes/{node_id}/drain")
    async def drain(node_id: str) -> dict[str, Any]:
        return await set_draining(node_id, True)

    @api.post("/nodes/{node_id}/undrain")
    async def undrain(node_id: str) -> dict[str, Any]:
        return await set_draining(node_id, False)

    @api.get("/route", response_model=None)
    async def route(prompt_tokens: int | None = Query(None, ge=1), max_tokens: int = Query(1, ge=1),
                    prompt: str | None = Query(None, min_length=1)) -> JSONResponse:
        nodes = view.snapshot()
        cached = None
        if prompt is not None:
            if tokenize is None:
                raise APIError(400, "this proxy cannot tokenize a prompt here: give prompt_tokens", param="prompt")
            ids = tokenize(prompt)
            prompt_tokens = len(ids)
            cached = expected_cached(nodes, ids) if expected_cached is not None else None
        if not prompt_tokens:
            raise APIError(400, "give prompt_tokens (a length) or prompt (a text)", param="prompt_tokens")
        plan = router.plan(nodes, prompt_tokens, max_tokens, cached=cached)
        body: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "prefill": None if plan.prefill is None else _pick(plan.prefill.to_dict(), "pcp", "cost",
                                                                 "cached_tokens"),
            "decode": None if plan.decode is None else _pick(plan.decode.to_dict(), "free_blocks", "running",
                                                             "cached_tokens"),
            "candidates": [_pick(c.to_dict(), "pcp", "cost", "eligible", "cached_tokens")
                           for c in plan.prefill_candidates],
            "decode_candidates": [_pick(c.to_dict(), "running", "free_blocks", "eligible", "cached_tokens")
                                  for c in plan.decode_candidates],
            "local_prefill": plan.local,  # the decode rank would prefill it itself (prefill is null)
        }
        if plan.decode is not None:
            spec = speculative_pairing(nodes, plan.prefill.node_id if plan.prefill is not None else None,
                                       plan.decode.node_id)
            if spec:
                body["speculative"] = spec
        if (plan.prefill is None and not plan.local) or plan.decode is None:
            role = "prefill" if plan.prefill is None and not plan.local else "decode"
            refused = plan.prefill_candidates if plan.prefill is None else plan.decode_candidates
            why = "; ".join(f"{c.node_id} rank {c.dp_rank}: {c.reason}" for c in refused) or f"no {role} node"
            err = APIError(503, f"no eligible {role} node for {prompt_tokens} prompt tokens ({why})",
                           code=f"no_{role}_node")
            return JSONResponse({**err.body(), **body}, status_code=503)
        return JSONResponse(body)

    return api


def _pick(d: dict[str, Any], *keys: str) -> dict[str, Any]:
    # Unknown values (the cost of an ineligible replica, free blocks not yet published) are left
    # out rather than sent as null, so clients can default them.
    picked = {k: d[k] for k in keys if d[k] is not None}
    return {"node_id": d["node_id"], "dp_rank": d["dp_rank"], **picked, "reason": d["reason"]}


def speculative_pairing(nodes: list[NodeState], prefill: str | None, decode: str) -> str | None:
    """What speculative decoding does on this route (``prefill`` None: the decode rank prefills it itself), or
    None where neither node runs it."""
    info = {n.info.node_id: n.info for n in nodes}
    k = info[decode].speculative_tokens if decode in info else 0
    p = info[prefill].speculative_tokens if prefill in info else 0
    if not k and not p:
        return None
    if not k:
        return f"{prefill} drafts with its MTP layer, {decode} does not run it: the draft goes unused"
    if prefill is None:
        return f"MTP, {k} tokens drafted a step, from the first decode step (the prompt is prefilled on {decode})"
    if not p and info[decode].mtp_recompute:
        return (f"{decode} runs MTP ({k} tokens a step), {prefill} does not: {decode} computes the MTP layer's KV "
                "itself (it prefills the prompt again instead of pulling its KV), then drafts from the next step")
    if not p:
        return (f"{decode} runs MTP ({k} tokens a step), {prefill} does not: no MTP layer KV travels and {decode} "
                "does not compute it (mtp_recompute off), so the request decodes without drafts")
    return f"MTP, {k} tokens drafted a step, from the first decode step: {prefill}'s draft and MTP KV travel"
