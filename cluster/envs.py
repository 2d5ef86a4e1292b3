"""Environment variables the cluster's processes read: all of them, typed, read when asked.

- ``PDCLUSTER_API_KEY``: the proxy's API key when ``--api-key`` is not given.
- ``PDCLUSTER_ADMIN_KEY``: the proxy's admin key when ``--admin-key`` is not given; ``pdctl``'s
  admin commands send it. Keys in the environment are not visible to other users in ``ps``, as
  command-line flags are, so the launcher passes them this way.
- ``PDCLUSTER_VLLM_KV_CACHE_BYTES``: ``--engine vllm`` nodes' KV cache size (vLLM's
  ``kv_cache_memory_bytes``; default 256 MiB).
"""

from __future__ import annotations

import os

API_KEY = "PDCLUSTER_API_KEY"
ADMIN_KEY = "PDCLUSTER_ADMIN_KEY"
VLLM_KV_CACHE_BYTES = "PDCLUSTER_VLLM_KV_CACHE_BYTES"


def api_key() -> str | None:
    return os.environ.get(API_KEY) or None


def admin_key() -> str | None:
    return os.environ.get(ADMIN_KEY) or None


def vllm_kv_cache_bytes() -> int:
    value = os.environ.get(VLLM_KV_CACHE_BYTES, "")
    try:
        return int(value) if value else 256 << 20
    except ValueError:
        raise ValueError(f"{VLLM_KV_CACHE_BYTES} must be a number of bytes, got {value!r}") from None
