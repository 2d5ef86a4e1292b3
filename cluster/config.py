"""Configuration every cluster process shares: frozen dataclasses, validated on construction.

Nodes compose an ``EngineConfig`` (the engine's knobs) with their service settings; the proxy has
its own. The processes' flags are generated from these dataclasses (``cluster.flags``): to add a
knob, add a field to the dataclass, with its help in ``metadata``; it becomes a flag (and, for a
node, a key of a ``pdctl up`` topology's nodes) with its default, so the two never disagree. Which
fields are not node flags, which are one role's, and the historic flag names are below (NODE_*).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the proxy uses this module too and must not load torch
    from engine.engine_config import EngineConfig

ROLES = ("prefill", "decode")
# How long ``pdctl down`` lets each process stop before SIGKILL: more than a node's own grace for
# in-flight requests (NodeConfig.grace_s, 30 s) plus its shutdown.
DOWN_GRACE_S = 45.0
ENGINE_BACKENDS = ("native", "vllm")
DP_PROCESSES = ("auto", "on", "off")
KV_PROTOCOLS = ("auto", "tcp", "rdma", "nvlink_intra")  # Mooncake transports (kv_transfer/protocol.py)


@dataclass(frozen=True)
class RegistryConfig:
    """Where the Redis registry is and how fresh a node's heartbeat must be."""

    url: str = field(default="redis://127.0.0.1:6379/0", metadata={"help": "the Redis registry", "metavar": "URL"})
    cluster: str = field(default="pdcluster", metadata={
        "help": "key prefix: two clusters can share one Redis", "metavar": "NAME"})
    ttl_s: float = field(default=5.0, metadata={
        "help": "a node whose heartbeat is older than this is unhealthy (its key expires)"})
    heartbeat_s: float = field(default=1.0, metadata={"help": "how often nodes publish their load"})

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"registry url must be redis://, rediss:// or unix://, got {self.url!r}")
        if not self.cluster or ":" in self.cluster:
            raise ValueError(f"cluster name must be non-empty without ':', got {self.cluster!r}")
        if not 0 < self.heartbeat_s < self.ttl_s:
            raise ValueError(f"need 0 < heartbeat_s ({self.heartbeat_s}) < ttl_s ({self.ttl_s})")


@dataclass(frozen=True)
class NodeConfig:
    """A prefill or decode node: its engine, where it listens, and the registry it joins."""

    role: str
    node_id: str = field(metadata={"help": "unique within the cluster, e.g. prefill-0", "metavar": "ID"})
    engine: EngineConfig
    host: str = field(default="127.0.0.1", metadata={"help": "gRPC listen address"})
    port: int = field(default=0, metadata={"help": "gRPC port; 0 = a free one, published in the registry"})
    metrics_port: int = field(default=0, metadata={
        "help": "HTTP port of the node's Prometheus /metrics (on --host); 0 = a free one, published in the "
                "registry; -1 = none"})
    advertise_host: str | None = field(default=None, metadata={
        "help": "the host name others dial, for gRPC and the KV transport (default: --host)", "metavar": "HOST"})
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    lease_s: float = field(default=30.0, metadata={
        "help": "prefill: how long a finished prefill keeps its KV for the decode side"})
    transfer_timeout_s: float = field(default=30.0, metadata={"help": "decode: the longest a KV pull may take"})
    max_queued_prefills: int = field(default=256, metadata={
        "help": "prefill: requests the node queues (waiting or prefilling); more are refused with "
                "RESOURCE_EXHAUSTED, which the proxy takes to another replica"})
    kv_protocol: str = field(default="auto", metadata={
        "help": "the KV transport's Mooncake protocol: nvlink_intra (GPU caches, nodes on one host), rdma, "
                "tcp; auto: nvlink_intra for a GPU cache on a loopback address, else rdma where the host "
                "has RDMA devices, else tcp (every node of a cluster must end up with the same one)",
        "choices": KV_PROTOCOLS})
    dp_processes: str = field(default="auto", metadata={
        "help": "decode: run each DP replica in its own process (on: always; off: threads of the node's "
                "process; auto: processes on GPUs or with enable_expert_parallel, threads on CPU otherwise)",
        "choices": DP_PROCESSES})
    grace_s: float = field(default=30.0, metadata={
        "help": "on SIGTERM: how long in-flight requests may run before they are aborted"})
    engine_backend: str = field(default="native", metadata={
        "help": "native: pdcluster's engine (engine/); vllm: an in-process vLLM engine with PdKVConnector "
                "(needs vllm importable; DP 1, --tp/--dcp/--pcp/--pp)", "choices": ENGINE_BACKENDS})
    # vLLM nodes only (the native engine has neither): tensor parallel and decode context parallel
    # sizes of the node's vLLM engine (vLLM's MLA cache is replicated across TP, sharded across DCP).
    tp: int = field(default=1, metadata={"help": "tensor parallel size (--engine vllm only)"})
    dcp: int = field(default=1, metadata={"help": "decode context parallel size (--engine vllm only)"})

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.node_id or ":" in self.node_id:
            raise ValueError(f"node_id must be non-empty without ':', got {self.node_id!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if not -1 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [-1, 65536), got {self.metrics_port}")
        if self.max_queued_prefills <= 0:
            raise ValueError(f"max_queued_prefills must be > 0, got {self.max_queued_prefills}")
        for name in ("lease_s", "transfer_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if self.kv_protocol not in KV_PROTOCOLS:
            raise ValueError(f"kv_protocol must be one of {KV_PROTOCOLS}, got {self.kv_protocol!r}")
        if self.dp_processes not in DP_PROCESSES:
            raise ValueError(f"dp_processes must be one of {DP_PROCESSES}, got {self.dp_processes!r}")
        if self.engine_backend not in ENGINE_BACKENDS:
            raise ValueError(f"engine_backend must be one of {ENGINE_BACKENDS}, got {self.engine_backend!r}")
        if self.role == "decode" and (self.engine.pcp != 1 or self.engine.pp != 1):
            raise ValueError("a decode node runs DP replicas only: pcp and pp must be 1")
        if (self.role == "decode" and self.engine_backend == "native" and self.engine.enable_expert_parallel
                and self.engine.dp > 1 and self.dp_processes == "off"):
            raise ValueError("enable_expert_parallel across a decode node's DP replicas makes them one "
                             "torch.distributed group, one process each: dp_processes must be on or auto, not off")
        if self.tp < 1 or self.dcp < 1:
            raise ValueError(f"tp and dcp must be >= 1, got {self.tp} and {self.dcp}")
        if self.engine_backend == "native" and (self.tp != 1 or self.dcp != 1):
            raise ValueError("tp and dcp are vLLM's (--engine vllm); the native engine runs DP x PCP x PP")
        if self.engine_backend == "vllm" and self.engine.dp != 1:
            raise ValueError("--engine vllm runs one vLLM engine per node: dp must be 1 (start more nodes)")

    @property
    def dial_host(self) -> str:
        return self.advertise_host or self.host


@dataclass(frozen=True)
class ProxyConfig:
    """The OpenAI-compatible HTTP front end."""

    model: str = field(metadata={"help": "model directory (tokenizer, chat template, config.json)", "metavar": "DIR"})
    served_model_name: str | None = field(default=None, metadata={
        "help": 'the name clients pass as "model" (default: the directory\'s name)', "metavar": "NAME"})
    host: str = field(default="127.0.0.1", metadata={"help": "HTTP listen address"})
    port: int = field(default=8000, metadata={"help": "HTTP port"})
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    api_key: str | None = field(default=None, metadata={
        "help": "when set, /v1/* needs 'Authorization: Bearer KEY'", "metavar": "KEY"})
    admin_key: str | None = field(default=None, metadata={
        "help": "when set, /admin/* (drain, undrain, route, status) needs 'Authorization: Bearer KEY'",
        "metavar": "KEY"})
    prefill_timeout_s: float = field(default=300.0, metadata={"help": "the longest wait for a prefill answer"})
    token_timeout_s: float = field(default=60.0, metadata={"help": "the longest wait between two decode events"})
    refresh_s: float = field(default=0.5, metadata={"help": "how often the proxy refreshes its view of the registry"})
    max_inflight_requests: int = field(default=4096, metadata={
        "help": "generation requests in flight at once; more get 503 with Retry-After (0: no limit)"})
    insecure_admin: bool = field(default=False, metadata={
        "help": "serve /admin/* without an admin key on a non-loopback address (refused otherwise: anyone who "
                "reaches the port could drain nodes)"})
    local_prefill_max_tokens: int = field(default=0, metadata={
        "help": "prompts of at most this many tokens are prefilled on the decode node itself (conditional "
                "disaggregation; native decode nodes); 0: none"})
    local_prefill_fallback: bool = field(default=True, metadata={
        "help": "prefill on a decode node when no prefill node can take a request (a cluster of decode nodes "
                "only serves colocated)"})
    rate_limit_rps: float = field(default=0.0, metadata={
        "help": "generation requests per second per API key (per client address without an API key); more get "
                "429 with Retry-After; 0: no limit"})
    rate_limit_burst: int = field(default=0, metadata={
        "help": "requests a caller may send at once above the rate (0: the rate, at least 1)"})
    circuit_failures: int = field(default=3, metadata={
        "help": "consecutive failed calls that open a node's circuit breaker (a refused connection opens it at "
                "once); a passing health probe half-opens it, a good call closes it"})
    health_probe_s: float = field(default=1.0, metadata={
        "help": "how often open nodes (and, while the registry is unreachable, every node) are health-probed"})
    workers: int = field(default=1, metadata={
        "help": "HTTP worker processes sharing the port, each with its own view of the registry and its own "
                "node connections (0: one per CPU core)"})
    pin_workers: bool = field(default=True, metadata={
        "help": "each worker process on one CPU core of those the proxy may use, its threads' hand-offs kept "
                "on that core (measured: less added latency and CPU per request, benchmarks/proxy.py)"})
    access_log: bool = field(default=True, metadata={
        "help": "a log line per HTTP request at info level (the HTTP server's access log; uvicorn's was "
                "measured at 10%% of the proxy's CPU per request on null nodes, benchmarks/proxy.py)"})

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.max_inflight_requests < 0:
            raise ValueError(f"max_inflight_requests must be >= 0, got {self.max_inflight_requests}")
        if self.local_prefill_max_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens must be >= 0, got {self.local_prefill_max_tokens}")
        if self.rate_limit_rps < 0 or self.rate_limit_burst < 0:
            raise ValueError(f"rate_limit_rps and rate_limit_burst must be >= 0, got {self.rate_limit_rps}, "
                             f"{self.rate_limit_burst}")
        if self.circuit_failures < 1:
            raise ValueError(f"circuit_failures must be >= 1, got {self.circuit_failures}")
        for name in ("prefill_timeout_s", "token_timeout_s", "refresh_s", "health_probe_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


# --- the node processes' flags (node_runtime.cli) and a topology's node keys (pdctl.topology) ---
# Every field of NodeConfig, RegistryConfig and EngineConfig is a flag of both node roles, named
# --kebab-case of the field (or of its rename below), except these (with why):
NODE_NOT_FLAGS = frozenset({
    "role",  # the program: python -m prefill_node or python -m decode_node
    "engine",  # composed from the EngineConfig flags
    "registry",  # composed from the RegistryConfig flags
    "dist_host", "dist_port",  # EngineConfig's rank rendezvous: the node sets them (its transfer host, a free port)
    # EngineConfig's: a node uses the model directory's tokenizer, as the proxy does (the two must agree)
    "tokenizer", "skip_tokenizer_init",
})
# One role's fields: flags of that role only.
NODE_ROLE_ONLY = {
    "prefill": frozenset({"pcp", "pp", "kv_layout", "kv_interleave", "lease_s", "max_queued_prefills"}),
    "decode": frozenset({"transfer_timeout_s", "dp_processes"}),
}
# Historic flag names (field -> key): --engine is NodeConfig.engine_backend, --registry-url RegistryConfig.url.
NODE_RENAMES = {"engine_backend": "engine", "url": "registry_url"}


def node_not_flags(role: str) -> frozenset[str]:
    """The fields that are no flags of a ``role`` node: NODE_NOT_FLAGS and the other roles' own."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return NODE_NOT_FLAGS.union(*(only for r, only in NODE_ROLE_ONLY.items() if r != role))
