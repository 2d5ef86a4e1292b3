"""Routing: which prefill replica and which decode rank take a request, and why.

Prefill candidates are the (node, dp_rank) replicas of healthy, non-draining prefill nodes of the
model; each replica is one PCP group. The estimated cost of a prompt of ``n`` tokens on a replica,
in units of "token-times of one rank", is

    cost = (queued + n) / effective_pcp(pcp, n) + PCP_OVERHEAD_TOKENS * (pcp - 1)

``queued`` is the replica's queued prefill tokens from the registry plus what this proxy sent
there and has not seen answered (heartbeats lag a second behind). PCP splits a prompt's tokens
over ``pcp`` ranks, but a short prompt leaves each rank too little work to gain much, so the
speedup ramps from 1 to ``pcp`` as the prompt grows to ``long_prompt_tokens``. The overhead term
stands for the per-layer all-gathers of a PCP group: with equal load a short prompt goes to the
smaller group and leaves the big one free for long prompts. Long prompts go to the largest PCP
groups, short ones to the least loaded; the lowest cost wins.

Decode candidates are the (node, dp_rank) ranks of healthy, non-draining decode nodes of the
model that have enough free KV blocks for prompt + output (when their load is known); the one
with the fewest running sequences (registry + this proxy's in flight) wins, then the one with the
most free blocks. A decode rank with prefix caching that probably holds the start of the prompt (a
conversation's earlier turns: its prompt and the answer the rank computed) pulls only the rest, so
among the ranks within ``decode_hit_slack`` running sequences of the least loaded, the one expected
to hold the most of the prompt wins.

Engines: a vLLM prefill node's KV (vLLM's ``kv_transfer_params``) can be read only by a vLLM decode
node; a native prefill node's ``KVHandle`` by either. A prefill replica no eligible decode rank can
read from is not eligible, and the decode rank is chosen among those that can read the chosen
prefill replica's KV.

Prefix caching: a prefill replica whose cache probably holds the start of the prompt
(``proxy.routing.prefix_index``, the proxy's record of what it sent where) computes only the rest, so its
cost counts only those tokens: prompts sharing a prefix go where it is cached, unless that replica's
queue outweighs the saving.

Exact ties are broken deterministically: candidates sorted by (node_id, dp_rank), then turn by
turn among the tied ones, so an idle cluster still spreads requests. Every decision carries a
human-readable reason; ``Router.plan`` explains without deciding (the admin route endpoint).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, NamedTuple, TypeVar

from cluster.nodes import NodeState, ReplicaLoad

LONG_PROMPT_TOKENS = 2048  # prompt length from which a PCP group reaches its full speedup
PCP_OVERHEAD_TOKENS = 16.0  # fixed cost of each extra PCP rank, in token-times
DECODE_HIT_SLACK = 4  # running sequences a decode rank holding the prompt's prefix may have over the least loaded


def effective_pcp(pcp: int, prompt_tokens: int, long_prompt_tokens: int = LONG_PROMPT_TOKENS) -> float:
    """The speedup a PCP group of ``pcp`` ranks gives a prompt of ``prompt_tokens``: 1 for tiny
    prompts, ``pcp`` from ``long_prompt_tokens`` on, linear in between."""
    return min(float(pcp), 1.0 + (pcp - 1) * min(1.0, prompt_tokens / long_prompt_tokens))


def prefill_cost(queued_tokens: int, prompt_tokens: int, pcp: int,
                 long_prompt_tokens: int = LONG_PROMPT_TOKENS) -> float:
    """Estimated time, in token-times of one rank, until a prompt sent now is prefilled."""
    speedup = effective_pcp(pcp, prompt_tokens, long_prompt_tokens)
    return (queued_tokens + prompt_tokens) / speedup + PCP_OVERHEAD_TOKENS * (pcp - 1)


CachedTokens = Callable[[str, int], int]  # (node id, DP rank) -> prompt tokens expected in its prefix cache


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // max(1, block_size))


class LocalLoad:
    """What this proxy has sent to each replica and not yet seen finish (heartbeats lag).

    ``tokens``: prompt tokens in a Prefill call not yet answered; ``seqs``: requests decoding (or
    about to) on a decode rank; ``blocks``: KV blocks those requests will need there;
    ``requests``: requests in flight per node (prefill: until the decode side has the KV).
    """

    def __init__(self) -> None:
        self._tokens: dict[tuple[str, int], int] = defaultdict(int)
        self._seqs: dict[tuple[str, int], int] = defaultdict(int)
        self._blocks: dict[tuple[str, int], int] = defaultdict(int)
        self._requests: dict[str, int] = defaultdict(int)

    def add(self, node_id: str, dp_rank: int, *, tokens: int = 0, seqs: int = 0, blocks: int = 0,
            requests: int = 0) -> None:
        key = (node_id, dp_rank)
        self._tokens[key] += tokens
        self._seqs[key] += seqs
        self._blocks[key] += blocks
        self._requests[node_id] += requests

    def remove(self, node_id: str, dp_rank: int, *, tokens: int = 0, seqs: int = 0, blocks: int = 0,
               requests: int = 0) -> None:
        self.add(node_id, dp_rank, tokens=-tokens, seqs=-seqs, blocks=-blocks, requests=-requests)

    def tokens(self, node_id: str, dp_rank: int) -> int:
        return self._tokens.get((node_id, dp_rank), 0)

    def seqs(self, node_id: str, dp_rank: int) -> int:
        return self._seqs.get((node_id, dp_rank), 0)

    def blocks(self, node_id: str, dp_rank: int) -> int:
        return self._blocks.get((node_id, dp_rank), 0)

    def requests(self, node_id: str) -> int:
        return self._requests.get(node_id, 0)


# The routing types are not frozen: a frozen dataclass's __init__ took 1.9 against 0.34 us, and routing
# makes four per request. Nothing changes them after they are made (``replace`` makes new ones).
@dataclass(slots=True)
class PrefillCandidate:
    node_id: str
    address: str
    dp_rank: int
    pcp: int
    queued_tokens: int  # registry + local
    cost: float  # inf when not eligible
    eligible: bool
    reason: str
    cached_tokens: int = 0  # the prompt's tokens expected in its prefix cache (proxy.routing.prefix_index)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cost"] = round(self.cost, 1) if math.isfinite(self.cost) else None
        return d


@dataclass(slots=True)
class DecodeCandidate:
    node_id: str
    address: str
    dp_rank: int
    running: int  # registry + local
    free_blocks: int | None  # None: the rank has not published its load yet
    needed_blocks: int
    eligible: bool
    reason: str
    cached_tokens: int = 0  # the prompt's tokens expected in its prefix cache: not pulled (proxy.routing.prefix_index)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class RoutePlan:
    """Every candidate with its verdict, and the choice (None where there is none). ``local``: the
    decode rank prefills the request itself (no prefill replica is chosen)."""

    prefill: PrefillCandidate | None
    decode: DecodeCandidate | None
    prefill_candidates: list[PrefillCandidate]
    decode_candidates: list[DecodeCandidate]
    local: bool = False


@dataclass(slots=True)
class Route:
    prefill: PrefillCandidate | None  # None: a local prefill on the decode rank
    decode: DecodeCandidate


class NoRoute(Exception):
    """No eligible prefill replica or decode rank; ``code`` is "no_prefill_node" or "no_decode_node"."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _ineligible_reason(node: NodeState, model: str, total_tokens: int) -> str | None:
    if not node.healthy:
        return "unhealthy (no recent heartbeat)"
    if node.draining:
        return "draining"
    if node.info.model != model:
        return f"serves model {node.info.model!r}, not {model!r}"
    if total_tokens > node.info.max_model_len:
        return f"{total_tokens} tokens exceed its max_model_len {node.info.max_model_len}"
    return None


def _load(node: NodeState, dp_rank: int) -> ReplicaLoad | None:
    return next((r for r in node.replicas if r.dp_rank == dp_rank), None)


def _replicas(nodes: Iterable[NodeState], role: str) -> list[tuple[NodeState, int]]:
    picked = sorted((n for n in nodes if n.info.role == role), key=lambda n: n.info.node_id)
    return [(n, dp) for n in picked for dp in range(n.info.dp)]


def prefill_candidates(nodes: Iterable[NodeState], model: str, prompt_tokens: int, total_tokens: int,
                       local: LocalLoad, long_prompt_tokens: int = LONG_PROMPT_TOKENS,
                       exclude: Collection[str] = (), cached: CachedTokens | None = None,
                       explain: bool = True) -> list[PrefillCandidate]:
    """Every prefill replica with its estimated cost for a prompt of ``prompt_tokens``; nodes in
    ``exclude`` (they just failed this request) are not eligible. ``cached(node, dp_rank)``: the
    prompt's tokens expected in that replica's prefix cache, which it need not compute. Without
    ``explain`` an eligible replica's reason is left empty (routing a request needs none)."""
    out = []
    for node, dp in _replicas(nodes, "prefill"):
        info = node.info
        load = _load(node, dp)
        queued = (load.queued_prefill_tokens if load else 0) + local.tokens(info.node_id, dp)
        bad = _ineligible_reason(node, model, total_tokens)
        if bad is None and info.node_id in exclude:
            bad = "failed this request already"
        if bad is not None:
            out.append(PrefillCandidate(info.node_id, info.address, dp, info.pcp, queued, math.inf, False, bad))
            continue
        hit = min(cached(info.node_id, dp), prompt_tokens - 1) if cached is not None else 0
        new = prompt_tokens - hit
        cost = prefill_cost(queued, new, info.pcp, long_prompt_tokens)
        if not explain:
            out.append(PrefillCandidate(info.node_id, info.address, dp, info.pcp, queued, cost, True, "", hit))
            continue
        speedup = effective_pcp(info.pcp, new, long_prompt_tokens)
        why = f"estimated cost {cost:.0f} (queued {queued} + {new} tokens over effective PCP {speedup:.2f}"
        why += f" + PCP overhead {PCP_OVERHEAD_TOKENS * (info.pcp - 1):.0f})" if info.pcp > 1 else ")"
        if hit:
            why += f"; {hit} of the prompt's tokens expected in its prefix cache"
        out.append(PrefillCandidate(info.node_id, info.address, dp, info.pcp, queued, cost, True, why, hit))
    return out


def decode_candidates(nodes: Iterable[NodeState], model: str, total_tokens: int,
                      local: LocalLoad, exclude: Collection[tuple[str, int]] = (),
                      cached: CachedTokens | None = None, explain: bool = True) -> list[DecodeCandidate]:
    """Every decode rank with its load, for a request of ``total_tokens`` (prompt + output).

    ``exclude``: (node id, DP rank) pairs that refused this request already. ``cached(node, dp_rank)``:
    the prompt's tokens expected in that rank's prefix cache, which it need not pull. Without
    ``explain`` an eligible rank's reason is left empty."""
    out = []
    for node, dp in _replicas(nodes, "decode"):
        info = node.info
        load = _load(node, dp)
        running = (load.running + load.waiting if load else 0) + local.seqs(info.node_id, dp)
        published = None if load is None else load.free_blocks
        needed = blocks_for(total_tokens, info.block_size)
        bad = _ineligible_reason(node, model, total_tokens)
        if bad is None and (info.node_id, dp) in exclude:
            bad = "refused this request already"
        if bad is None and needed > info.num_blocks:
            bad = f"needs {needed} KV blocks, has {info.num_blocks} in all"
        # Eligibility trusts the node's own count; the blocks this proxy sent since only lower the
        # rank (subtracting them too would count a request twice once the heartbeat catches up,
        # and refuse requests a node can take).
        if bad is None and published is not None and published < needed:
            bad = f"needs {needed} KV blocks, {published} free"
        free = None if published is None else published - local.blocks(info.node_id, dp)
        hit = cached(info.node_id, dp) if cached is not None and bad is None else 0
        if bad is not None or not explain:
            why = bad or ""
        else:
            free_text = "free blocks unknown" if free is None else f"{free} free blocks"
            why = f"{running} running, {free_text}, needs {needed}" + (
                f"; {hit} of the prompt's tokens expected in its prefix cache" if hit else "")
        out.append(DecodeCandidate(info.node_id, info.address, dp, running, free, needed, bad is None, why, hit))
    return out


C = TypeVar("C", PrefillCandidate, DecodeCandidate)


def pick(candidates: Sequence[C], key: Callable[[C], tuple[float, ...]], turn: int = 0) -> C | None:
    """The eligible candidate with the lowest ``key``; exact ties go round by ``turn``."""
    eligible = [c for c in candidates if c.eligible]
    if len(eligible) <= 1:
        return eligible[0] if eligible else None
    best = min(key(c) for c in eligible)
    tied = [c for c in eligible if key(c) == best]  # already in (node_id, dp_rank) order
    return tied[turn % len(tied)]


def _prefill_key(c: PrefillCandidate) -> tuple[float, ...]:
    return (round(c.cost, 6),)  # rounded: equal replicas must tie despite float noise


def _decode_key(c: DecodeCandidate) -> tuple[float, ...]:
    return (c.running, -(c.free_blocks if c.free_blocks is not None else 0))


def decode_hit_slack(least_running: int) -> int:
    """How many more running sequences than the least loaded rank a rank holding the prompt's prefix
    may have and still be preferred (its hit saves the transfer, its load slows every stream there)."""
    return max(DECODE_HIT_SLACK, least_running // 4)


def pick_decode(candidates: Sequence[DecodeCandidate], turn: int = 0) -> tuple[DecodeCandidate | None, str]:
    """The decode rank and why: among ranks loaded within ``decode_hit_slack`` of the least loaded, the
    one expected to hold most of the prompt (decode-side reuse); without a hit, the least loaded."""
    eligible = [c for c in candidates if c.eligible]
    if eligible and any(c.cached_tokens for c in eligible):
        least = min(c.running for c in eligible)
        near = [c for c in eligible if c.running <= least + decode_hit_slack(least)]
        best = max(c.cached_tokens for c in near)
        if best:
            return pick([c for c in near if c.cached_tokens == best], _decode_key, turn), "most of the prompt cached"
    return pick(candidates, _decode_key, turn), "least loaded"


class Router:
    """Picks routes for one served model and keeps the proxy's local load."""

    def __init__(self, model: str, long_prompt_tokens: int = LONG_PROMPT_TOKENS, local_prefill_max_tokens: int = 0,
                 local_prefill_fallback: bool = True) -> None:
        """``local_prefill_max_tokens``: prompts up to this long are prefilled on the decode rank (conditional
        disaggregation); ``local_prefill_fallback``: so are others when no prefill replica can take them."""
        if long_prompt_tokens <= 0:
            raise ValueError(f"long_prompt_tokens must be > 0, got {long_prompt_tokens}")
        if local_prefill_max_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens must be >= 0, got {local_prefill_max_tokens}")
        self.model = model
        self.long_prompt_tokens = long_prompt_tokens
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.local_prefill_fallback = local_prefill_fallback
        self.load = LocalLoad()
        self._turn = 0

    def plan(self, nodes: Sequence[NodeState], prompt_tokens: int, max_tokens: int,
             exclude_prefill: Collection[str] = (), prefill_node: str | None = None,
             exclude_decode: Collection[tuple[str, int]] = (), local: bool | None = None,
             cached: CachedTokens | None = None, explain: bool = True) -> RoutePlan:
        """Judge every candidate and choose, without changing any state.

        ``prefill_node``: the request was prefilled there already; choose only a decode rank that
        can read its KV. ``exclude_decode``: (node id, DP rank) pairs not to choose. ``local``: True
        for a decode rank that prefills itself only, False never, None by the router's settings.
        ``cached``: the prompt's tokens expected in each prefill replica's prefix cache. ``explain``
        False: no reasons for eligible candidates, nor for the choice (``route``: the request needs none;
        ineligible candidates keep theirs, for the answer when nothing can take it).
        """
        total = prompt_tokens + max_tokens
        dec = decode_candidates(nodes, self.model, total, self.load, exclude_decode, cached, explain)
        plan = self._disaggregated(nodes, prompt_tokens, total, dec, exclude_prefill, prefill_node, cached, explain)
        if prefill_node is not None or local is False:
            return plan
        short = prompt_tokens <= self.local_prefill_max_tokens
        stuck = plan.prefill is None or plan.decode is None  # no disaggregated route
        if not (local or short or (self.local_prefill_fallback and stuck)):
            return plan
        capable = {n.info.node_id for n in nodes if n.info.local_prefill}
        d, how = pick_decode([c for c in dec if c.node_id in capable], self._turn)
        if d is None and not local:
            return plan
        if not explain:
            return RoutePlan(None, d, plan.prefill_candidates, dec, local=True)
        why = ("local prefill (asked)" if local else
               f"local prefill: a prompt of {prompt_tokens} <= {self.local_prefill_max_tokens} tokens" if short
               else "local prefill: no prefill replica can take it")
        return RoutePlan(None, None if d is None else _with_reason(d, f"{why}; {how}: {d.reason}"),
                         plan.prefill_candidates, dec, local=True)

    def _disaggregated(self, nodes: Sequence[NodeState], prompt_tokens: int, total: int, dec: list[DecodeCandidate],
                       exclude_prefill: Collection[str], prefill_node: str | None,
                       cached: CachedTokens | None = None, explain: bool = True) -> RoutePlan:
        """A prefill replica and a decode rank that can read its KV."""
        engines = {n.info.node_id: KVKind(n.info.engine, n.info.kv_protocol, n.info.kv_cache_dtype) for n in nodes}
        pre = prefill_candidates(nodes, self.model, prompt_tokens, total, self.load, self.long_prompt_tokens,
                                 exclude_prefill, cached, explain)
        # One kind of node (the usual cluster): every decode rank reads every prefill node's KV.
        mixed = len(set(engines.values())) > 1 or (prefill_node is not None and prefill_node not in engines)
        if mixed:
            readable = {e for e in set(engines.values())
                        if any(c.eligible and can_read(e, engines[c.node_id]) for c in dec)}
            pre = [c if not c.eligible or engines[c.node_id] in readable or not readable else
                   replace(c, cost=math.inf, eligible=False,
                           reason=f"no eligible decode rank can read a {_kind(engines[c.node_id])} node's KV")
                   for c in pre]
        p = pick(pre, _prefill_key, self._turn)
        # A prefill node that has left the view: assume the strictest (only vLLM decode reads both).
        source = (engines.get(prefill_node, KVKind("vllm", "tcp", "")) if prefill_node else
                  engines[p.node_id] if p else None)
        if mixed and source is not None:
            dec = [c if not c.eligible or can_read(source, engines[c.node_id]) else
                   replace(c, eligible=False, reason=f"a {_kind(engines[c.node_id])} decode node cannot read a "
                                                     f"{_kind(source)} node's KV")
                   for c in dec]
        d, how = pick_decode(dec, self._turn)
        if explain and p is not None:
            p = _with_reason(p, "lowest " + p.reason)
        if explain and d is not None:
            d = _with_reason(d, f"{how}: {d.reason}")
        return RoutePlan(p, d, pre, dec)

    def route(self, nodes: Sequence[NodeState], prompt_tokens: int, max_tokens: int,
              exclude_prefill: Collection[str] = (), cached: CachedTokens | None = None,
              local: bool | None = None) -> Route:
        """Choose a prefill replica and a decode rank (or a decode rank that prefills locally: ``prefill``
        None); raises ``NoRoute``. ``local`` False: never a local prefill (as in ``plan``)."""
        plan = self.plan(nodes, prompt_tokens, max_tokens, exclude_prefill, cached=cached, local=local, explain=False)
        if plan.local and plan.decode is not None:
            self._turn += 1
            return Route(None, plan.decode)
        if plan.prefill is None:
            raise NoRoute("no_prefill_node", _no_route_message("prefill", plan.prefill_candidates))
        if plan.decode is None:
            raise NoRoute("no_decode_node", _no_route_message("decode", plan.decode_candidates))
        self._turn += 1
        return Route(plan.prefill, plan.decode)


class KVKind(NamedTuple):
    """What decides whether a decode node can take a prefill node's KV."""

    engine: str  # "native" | "vllm"
    protocol: str  # the Mooncake protocol
    kv_format: str  # the cache's row format ("": not published, an older node: matches any)


def can_read(prefill: KVKind, decode: KVKind) -> bool:
    """Whether a ``decode`` node can pull the KV a ``prefill`` node holds: a vLLM prefill node's only into
    vLLM decode nodes, both ends on the same Mooncake protocol and the same cache format."""
    return ((prefill.engine != "vllm" or decode.engine == "vllm") and prefill.protocol == decode.protocol
            and (prefill.kv_format == decode.kv_format or not prefill.kv_format or not decode.kv_format))


def _kind(kind: KVKind) -> str:
    return f"{kind.engine} ({kind.protocol}{', ' + kind.kv_format + ' KV' if kind.kv_format else ''})"


def _with_reason(c: C, reason: str) -> C:
    return replace(c, reason=reason)


def _no_route_message(role: str, candidates: Sequence[PrefillCandidate | DecodeCandidate]) -> str:
    if not candidates:
        return f"no {role} node is registered"
    why = "; ".join(f"{c.node_id}/dp{c.dp_rank}: {c.reason}" for c in candidates[:8])
    return f"no {role} node can take this request ({why})"
