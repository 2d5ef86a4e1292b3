"""What the registry knows about a node: its identity and shape, its load, its flags.

Shared vocabulary of the nodes (which publish it), the registry (which stores it) and the proxy
(which routes by it). Plain frozen dataclasses; ``to_dict``/``from_dict`` give the JSON form the
registry stores and the admin API shows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class NodeInfo:
    """A node's identity and shape; fixed for the node's life."""

    node_id: str
    role: str  # "prefill" | "decode"
    address: str  # gRPC "host:port"
    model: str  # the served model name
    max_model_len: int
    dp: int
    pcp: int
    pp: int
    kv_layout: str  # "sharded" | "replicated" (decode: "replicated")
    block_size: int
    num_blocks: int  # KV blocks of one replica
    started_at: float  # unix time
    engine: str = "native"  # "native" | "vllm": which decode nodes can read a prefill node's KV
    kv_protocol: str = "tcp"  # the KV transport's Mooncake protocol: a pull needs both ends on the same one
    kv_cache_dtype: str = ""  # its KV rows' format (engine.kv_format's wire name): a pull needs both the same
    weights: str = ""  # how it holds the weights, in words (engine.fp8_compute.weights_held; "": not said)
    ep: int = 1  # expert parallelism: the ranks an EP group spans (each holds 1/ep of the routed experts)
    experts_per_rank: int = 0  # the routed experts each rank holds (all of them without EP; 0: no MoE layers)
    local_prefill: bool = False  # a decode node that can prefill a request itself (DecodeRequest.local_prefill)
    prefix_caching: bool = False  # its engine shares the KV of prompts' common prefixes (enable_prefix_caching)
    metrics_address: str = ""  # "host:port" of its Prometheus /metrics ("": it serves none)
    speculative_tokens: int = 0  # speculative decoding with the MTP layer: tokens drafted a step (0: off)
    mtp_recompute: bool = False  # a decode node with it: computes the MTP layer's KV of a prompt prefilled without

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> NodeInfo:
        return NodeInfo(**{k: d[k] for k in NodeInfo.__dataclass_fields__ if k in d})


@dataclass(frozen=True)
class NodeFailure:
    """Why a node stopped serving on its own (its engine failed: a rank or replica died or hung), kept in
    the registry for a while after it left (``cluster.registry.FAILURE_TTL_S``) so ``pdctl status`` can say."""

    node_id: str
    role: str
    why: str
    at: float  # unix time

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> NodeFailure:
        return NodeFailure(str(d["node_id"]), str(d["role"]), str(d["why"]), float(d["at"]))


@dataclass(frozen=True)
class ReplicaLoad:
    """One DP replica's load, as last published."""

    dp_rank: int
    queued_prefill_tokens: int = 0  # prompt tokens admitted but not yet prefilled
    waiting: int = 0
    running: int = 0
    used_blocks: int = 0
    free_blocks: int = 0  # cached blocks (prefix caching) count as free: they are evicted when needed
    cached_blocks: int = 0  # prefix caching: blocks kept for a later prompt with the same prefix
    prefix_hit_blocks: int = 0  # prefix caching, since start: blocks found in the cache ...
    prefix_query_blocks: int = 0  # ... of those looked up (full prompt blocks of requests starting)
    preemptions: int | None = None  # since start: running requests preempted for their blocks (None: unknown)
    held: int = 0  # prefill: finished requests whose KV waits under a lease for the decode side
    # Speculative decoding since start (None: off): verify steps with drafts, draft tokens, accepted ones.
    spec_drafts: int | None = None
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ReplicaLoad:
        return ReplicaLoad(**{k: d[k] for k in ReplicaLoad.__dataclass_fields__ if k in d})


@dataclass(frozen=True)
class KVEvents:
    """What joined and left one replica's prefix cache since its node's last report: block hashes
    (``engine.block_hash``). Published on the registry's pub/sub, read into the proxy's prefix
    index; a lost message costs only a worse guess."""

    node_id: str
    dp_rank: int
    started_at: float  # the node's: a restarted node's cache starts empty
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> KVEvents:
        return KVEvents(str(d["node_id"]), int(d["dp_rank"]), float(d["started_at"]),
                        tuple(int(h) for h in d.get("stored", ())), tuple(int(h) for h in d.get("removed", ())))


@dataclass(frozen=True)
class NodeState:
    """A node as the registry sees it now."""

    info: NodeInfo
    replicas: tuple[ReplicaLoad, ...] = field(default_factory=tuple)
    draining: bool = False
    heartbeat_at: float = 0.0  # unix time of the last heartbeat
    healthy: bool = True  # heartbeat within its TTL
    ttl_s: float = 0.0  # the TTL its heartbeats carry (--ttl-s of the node); 0: the reader's own

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.info.to_dict(),
            "replicas": [asdict(r) for r in self.replicas],
            "draining": self.draining,
            "heartbeat_at": self.heartbeat_at,
            "healthy": self.healthy,
        }
