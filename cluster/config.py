"""Configuration every cluster process shares: frozen dataclasses, validated on construction.

Nodes compose an ``EngineConfig`` (the engine's knobs) with their service settings; the proxy has
its own. CLI defaults come from these dataclasses, so a flag and its dataclass never disagree.
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


@dataclass(frozen=True)
class RegistryConfig:
    """Where the Redis registry is and how fresh a node's heartbeat must be."""

    url: str = "redis://127.0.0.1:6379/0"
    cluster: str = "pdcluster"  # key prefix: two clusters can share one Redis
    ttl_s: float = 5.0  # a node whose heartbeat is older than this is unhealthy (its key expires)
    heartbeat_s: float = 1.0  # how often nodes publish their load

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
    node_id: str
    engine: EngineConfig
    host: str = "127.0.0.1"  # gRPC listen address
    port: int = 0  # 0 = a free port, published in the registry
    advertise_host: str | None = None  # the host others dial (default: host)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    lease_s: float = 30.0  # prefill: how long finished prefills keep their KV for the decode side
    transfer_timeout_s: float = 30.0  # decode: the longest a KV pull may take
    grace_s: float = 30.0  # on SIGTERM: how long in-flight requests may run before they are aborted
    engine_backend: str = "native"  # "native" (engine/) or "vllm" (an in-process vLLM engine, vllm_backend.engine)
    # vLLM nodes only (the native engine has neither): tensor parallel and decode context parallel
    # sizes of the node's vLLM engine (vLLM's MLA cache is replicated across TP, sharded across DCP).
    tp: int = 1
    dcp: int = 1

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.node_id or ":" in self.node_id:
            raise ValueError(f"node_id must be non-empty without ':', got {self.node_id!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        for name in ("lease_s", "transfer_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if self.engine_backend not in ENGINE_BACKENDS:
            raise ValueError(f"engine_backend must be one of {ENGINE_BACKENDS}, got {self.engine_backend!r}")
        if self.role == "decode" and (self.engine.pcp != 1 or self.engine.pp != 1):
            raise ValueError("a decode node runs DP replicas only: pcp and pp must be 1")
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

    model: str  # model directory: tokenizer, chat template, config (context length)
    served_model_name: str | None = None  # the name clients pass as "model" (default: the directory's name)
    host: str = "127.0.0.1"
    port: int = 8000
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <api_key>"
    admin_key: str | None = None  # when set, /admin/* (drain, undrain, route, status) needs it
    prefill_timeout_s: float = 300.0  # the longest wait for a prefill answer
    token_timeout_s: float = 60.0  # the longest wait between two decode events
    refresh_s: float = 0.5  # how often the proxy refreshes its view of the registry

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        for name in ("prefill_timeout_s", "token_timeout_s", "refresh_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
