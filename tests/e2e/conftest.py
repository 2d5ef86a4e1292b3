"""A whole local cluster (redis, one PCP2 prefill node, two decode nodes, the proxy) per module.

Started with the launcher ``pdctl up`` uses, on free ports, and stopped with ``pdctl down``'s code;
nothing it started may outlive the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_cluster import ADMIN_KEY, Cluster, running_cluster

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
        # prefix caching on: the tests send the same prompts again, so later ones hit its sharded cache
        "prefill": [{"dp": 1, "pcp": 2, "kv_layout": "sharded", "max_model_len": 1024,
                     "max_num_batched_tokens": 256, "num_kv_blocks": 256, "lease_s": 10,
                     "enable_prefix_caching": True}],
        # The decode nodes run what GPU nodes run by default: overlapped decode steps (async_scheduling,
        # forced on here: a CPU's default is off), and decode-0's two replicas as processes; decode-1's one
        # runs as a thread (the CPU default). decode-0 caches prefixes (a conversation's next turn pulls
        # only its new blocks), decode-1 not.
        "decode": [{"dp": 2, "max_model_len": 1024, "num_kv_blocks": 256, "dp_processes": "on",
                    "async_scheduling": True, "enable_prefix_caching": True},
                   {"dp": 1, "max_model_len": 1024, "num_kv_blocks": 256, "async_scheduling": True,
                    "enable_prefix_caching": False}],
    })
    with running_cluster(topo, run_dir, tiny_model, cluster_run_dirs) as c:
        yield c
