"""kv_protocol auto: NVLink for GPU caches on a loopback address, RDMA where there are devices, else TCP."""

from __future__ import annotations

import pytest

from cluster.config import NodeConfig
from engine.engine_config import EngineConfig
from kv_transfer import protocol
from kv_transfer.protocol import choose_protocol


def test_auto_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol, "rdma_devices", lambda: [])
    assert choose_protocol("auto", True, "127.0.0.1") == "nvlink_intra"
    assert choose_protocol("auto", True, "localhost") == "nvlink_intra"
    assert choose_protocol("auto", False, "127.0.0.1") == "tcp"  # CPU caches
    assert choose_protocol("auto", True, "10.1.2.3") == "tcp"  # another host may be the peer
    monkeypatch.setattr(protocol, "rdma_devices", lambda: ["mlx5_0"])
    assert choose_protocol("auto", True, "10.1.2.3") == "rdma"
    assert choose_protocol("tcp", True, "127.0.0.1") == "tcp"  # forced


def test_node_config_checks_the_protocol() -> None:
    engine = EngineConfig(model="m")
    node = NodeConfig(role="decode", node_id="d", engine=engine, kv_protocol="nvlink_intra")
    assert node.kv_protocol == "nvlink_intra"
    with pytest.raises(ValueError, match="kv_protocol"):
        NodeConfig(role="decode", node_id="d", engine=engine, kv_protocol="ucx")
