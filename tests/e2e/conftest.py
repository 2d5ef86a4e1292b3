"""A whole local cluster (redis, one PCP2 prefill node, two decode nodes, the proxy) per module.

Started with the launcher ``pdctl up`` uses, on free ports, and stopped with ``pdctl down``'s code;
nothing it started may outlive the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from e2e_cluster import ADMIN_KEY, Cluster

from pdctl.launcher import down, up
from pdctl.topology import Topology


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
            cluster_run_dirs: list[Path]) -> Iterator[Cluster]:
    run_dir = tmp_path_factory.mktemp("cluster")
    topo = Topology.from_dict({
        "model": str(tiny_model),
        "served_model_name": "tiny",
        "registry": {"cluster": f"e2e-{run_dir.name}"},
        "proxy": {"port": 0, "admin_key": ADMIN_KEY},
        "prefill": [{"dp": 1, "pcp": 2, "kv_layout": "sharded", "max_model_len": 1024,
                     "max_num_batched_tokens": 256, "num_kv_blocks": 256, "lease_s": 10}],
        # decode-0's two replicas run as processes (GPU nodes' default), decode-1's one as a thread
        "decode": [{"dp": 2, "max_model_len": 1024, "num_kv_blocks": 256, "dp_processes": "on"},
                   {"dp": 1, "max_model_len": 1024, "num_kv_blocks": 256}],
    })
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    state = up(topo, run_dir, timeout_s=240)
    cluster_run_dirs.append(run_dir)
    admin = httpx.Client(base_url=state.proxy_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    try:
        yield Cluster(state.proxy_url, run_dir, tiny_model, admin)
    finally:
        admin.close()
        try:
            down(run_dir, grace_s=10)
        finally:
            cluster_run_dirs.remove(run_dir)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]
    for p in left:
        p.kill()
    assert not left, f"the cluster left processes behind: {[(p.pid, p.name()) for p in left]}"
