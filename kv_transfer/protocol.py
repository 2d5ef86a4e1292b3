"""Which Mooncake protocol a node's KV transport uses (``NodeConfig.kv_protocol``).

- ``nvlink_intra``: GPU caches of nodes on one host, read over NVLink through CUDA IPC (Mooncake's
  ``IntraNodeNvlinkTransport``; the engine needs ``MC_INTRANODE_NVLINK=1``, which the transport sets).
- ``rdma``: where the host has RDMA devices (``/sys/class/infiniband``).
- ``tcp``: anywhere; GPU caches go through host memory (about 2 GB/s between two H200s, measured).

``auto`` picks ``nvlink_intra`` for a GPU cache whose transport listens on a loopback address (every
node on this host, as ``pdctl up`` starts them), else ``rdma`` where there are RDMA devices, else
``tcp``. Both ends of a pull must use the same protocol; a cluster across hosts sets it explicitly.
"""

from __future__ import annotations

import ipaddress
import os

RDMA_SYSFS = "/sys/class/infiniband"


def rdma_devices() -> list[str]:
    try:
        return sorted(os.listdir(RDMA_SYSFS))
    except OSError:
        return []


def choose_protocol(requested: str, cache_on_cuda: bool, host: str) -> str:
    """The protocol to initialise Mooncake with, for a ``requested`` one (``auto`` or a protocol)."""
    if requested != "auto":
        return requested
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if cache_on_cuda and loopback:
        return "nvlink_intra"
    return "rdma" if rdma_devices() else "tcp"
