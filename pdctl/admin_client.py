"""The proxy's admin HTTP API as seen by ``pdctl``: typed answers, one clean error type.

Endpoints (served by the proxy; ``Authorization: Bearer <admin key>`` when it has one):
``GET /admin/nodes``, ``POST /admin/nodes/{id}/drain`` and ``/undrain``, ``GET /admin/route``.
Errors come as OpenAI-style ``{"error": {"message", "type", "code"}}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from cluster.nodes import NodeFailure, NodeInfo, NodeState, ReplicaLoad

KEY_HINT = "pass --admin-key or set PDCLUSTER_ADMIN_KEY"


class AdminError(RuntimeError):
    """An admin call failed; the message is meant for the user (no traceback needed)."""


@dataclass(frozen=True)
class AdminNode:
    """A node as the proxy's admin API shows it: its registry state and the proxy's in-flight count."""

    state: NodeState
    inflight: int
    raw: dict[str, Any]  # the JSON as received, for `pdctl nodes --json`
    circuit: str = "closed"  # the proxy's circuit breaker for the node: closed, half_open or open


@dataclass(frozen=True)
class ClusterView:
    """``GET /admin/nodes``: the nodes, and whether the proxy's registry view is fresh."""

    nodes: list[AdminNode]
    registry: str  # "ok", or "stale": Redis is unreachable and the proxy routes on its last view
    registry_error: str | None = None
    failed: tuple[NodeFailure, ...] = ()  # nodes that stopped serving lately because their engine failed


@dataclass(frozen=True)
class PrefillChoice:
    node_id: str
    dp_rank: int
    pcp: int
    cost: float
    reason: str
    cached_tokens: int = 0  # the prompt's tokens expected in its prefix cache (a route for a prompt's text)


@dataclass(frozen=True)
class DecodeChoice:
    node_id: str
    dp_rank: int
    reason: str
    cached_tokens: int = 0


@dataclass(frozen=True)
class Candidate:
    node_id: str
    dp_rank: int
    pcp: int
    cost: float
    eligible: bool
    reason: str


@dataclass(frozen=True)
class DecodeCandidate:
    node_id: str
    dp_rank: int
    running: int
    free_blocks: int
    eligible: bool
    reason: str


@dataclass(frozen=True)
class Route:
    """Where the proxy would send a prompt of a given length (or text) now, and why."""

    prefill: PrefillChoice | None  # None: the decode rank prefills locally
    decode: DecodeChoice
    candidates: tuple[Candidate, ...]  # prefill replicas
    decode_candidates: tuple[DecodeCandidate, ...] = ()
    prompt_tokens: int = 0
    speculative: str | None = None  # what speculative decoding does on this route (None: neither node runs it)


class AdminClient:
    """A client of one proxy's admin API; every call has a timeout."""

    def __init__(self, base_url: str, admin_key: str | None = None, timeout_s: float = 10.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s, transport=transport)

    def nodes(self) -> list[AdminNode]:
        return self.view().nodes

    def view(self) -> ClusterView:
        body = self._call("GET", "/admin/nodes")
        try:
            return ClusterView([_node(d) for d in body["nodes"]], str(body.get("registry", "ok")),
                               body.get("registry_error"),
                               tuple(NodeFailure.from_dict(f) for f in body.get("failed", ())))
        except (KeyError, TypeError, ValueError) as e:
            raise AdminError(f"unexpected answer from {self.base_url}/admin/nodes: {e!r}") from None

    def set_draining(self, node_id: str, draining: bool) -> bool:
        """Drain or undrain a node; returns its draining flag as the proxy reports it."""
        action = "drain" if draining else "undrain"
        body = self._call("POST", f"/admin/nodes/{quote(node_id, safe='')}/{action}", not_found=f"no node {node_id!r}")
        return bool(body.get("draining", draining))

    def route(self, prompt_tokens: int | None, max_tokens: int | None = None, prompt: str | None = None) -> Route:
        """The route for a prompt of ``prompt_tokens`` tokens, or of the text ``prompt`` (which counts
        the prefix caches' expected hits)."""
        params: dict[str, Any] = {"prompt": prompt} if prompt is not None else {"prompt_tokens": prompt_tokens}
        if max_tokens is not None:
            params["max_tokens"] = max_tokens
        body = self._call("GET", "/admin/route", params=params)
        try:
            p, d = body["prefill"], body["decode"]
            return Route(
                prefill=None if p is None and body.get("local_prefill") else
                PrefillChoice(str(p["node_id"]), int(p["dp_rank"]), int(p.get("pcp", 1)),
                              float(p.get("cost", 0.0)), str(p.get("reason", "")), int(p.get("cached_tokens", 0))),
                decode=DecodeChoice(str(d["node_id"]), int(d["dp_rank"]), str(d.get("reason", "")),
                                    int(d.get("cached_tokens", 0))),
                prompt_tokens=int(body.get("prompt_tokens", prompt_tokens or 0)),
                speculative=body.get("speculative"),
                candidates=tuple(
                    Candidate(str(c["node_id"]), int(c["dp_rank"]), int(c.get("pcp", 1)), float(c.get("cost", 0.0)),
                              bool(c.get("eligible", True)), str(c.get("reason", "")))
                    for c in body.get("candidates", [])
                ),
                decode_candidates=tuple(
                    DecodeCandidate(str(c["node_id"]), int(c["dp_rank"]), int(c.get("running", 0)),
                                    int(c.get("free_blocks", 0)), bool(c.get("eligible", True)),
                                    str(c.get("reason", "")))
                    for c in body.get("decode_candidates", [])
                ),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise AdminError(f"unexpected answer from {self.base_url}/admin/route: {e!r}") from None

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, params: dict[str, Any] | None = None,
              not_found: str | None = None) -> dict[str, Any]:
        try:
            response = self._http.request(method, path, params=params)
        except httpx.TimeoutException:
            raise AdminError(f"the proxy at {self.base_url} did not answer in time") from None
        except httpx.HTTPError as e:
            raise AdminError(f"cannot reach the proxy at {self.base_url}: {e}") from None
        if response.status_code == 401:
            raise AdminError(f"the proxy refused the admin key ({_message(response)}); {KEY_HINT}")
        if response.status_code == 404 and not_found is not None:
            raise AdminError(_error_message(response) or not_found)
        if response.status_code >= 400:
            raise AdminError(f"{method} {path}: the proxy answered {response.status_code}: {_message(response)}")
        try:
            body = response.json()
        except ValueError:
            raise AdminError(f"{method} {path}: the proxy answered with something other than JSON") from None
        if not isinstance(body, dict):
            raise AdminError(f"{method} {path}: expected a JSON object, got {type(body).__name__}")
        return body


def _message(response: httpx.Response) -> str:
    """The message of an OpenAI-style error body, else the start of the body."""
    return _error_message(response) or response.text[:200] or response.reason_phrase


def _error_message(response: httpx.Response) -> str | None:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return None


def _node(d: dict[str, Any]) -> AdminNode:
    state = NodeState(
        info=NodeInfo.from_dict(d),
        replicas=tuple(ReplicaLoad.from_dict(r) for r in d.get("replicas", [])),
        draining=bool(d.get("draining", False)),
        heartbeat_at=float(d.get("heartbeat_at", 0.0)),
        healthy=bool(d.get("healthy", False)),
    )
    return AdminNode(state=state, inflight=int(d.get("inflight", 0)), raw=d, circuit=str(d.get("circuit", "closed")))
