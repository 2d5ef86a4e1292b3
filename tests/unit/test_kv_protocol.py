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


# --- --engine vllm: the connector's workers make the same MooncakeTransport, with the node's protocol ---

def _vllm_node(role: str, kv_protocol: str, device: str = "cpu") -> NodeConfig:
    return NodeConfig(role=role, node_id="v", engine=EngineConfig(model="m", device=device), engine_backend="vllm",
                      kv_protocol=kv_protocol)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_vllm_node_hands_its_protocol_to_the_connector(monkeypatch: pytest.MonkeyPatch, role: str) -> None:
    from cluster.flags import source_knobs
    from vllm_backend.engine import connector_extra, kv_protocol

    monkeypatch.setattr(protocol, "rdma_devices", lambda: [])
    for requested in ("tcp", "rdma", "nvlink_intra"):  # given: passed through as it is
        assert kv_protocol(_vllm_node(role, requested), "127.0.0.1") == requested
    # auto: tcp, the only protocol vLLM nodes have run with (on GPUs too, and with RDMA devices)
    assert kv_protocol(_vllm_node(role, "auto"), "127.0.0.1") == "tcp"
    assert kv_protocol(_vllm_node(role, "auto", device="cuda:0"), "127.0.0.1") == "tcp"
    monkeypatch.setattr(protocol, "rdma_devices", lambda: ["mlx5_0"])
    assert kv_protocol(_vllm_node(role, "auto"), "10.1.2.3") == "tcp"
    assert kv_protocol(_vllm_node(role, "rdma"), "10.1.2.3") == "rdma"

    extra = connector_extra(_vllm_node(role, "rdma"), "10.1.2.3", 5701, "rdma")
    assert extra["mooncake_protocol"] == "rdma" and extra["mooncake_host"] == "10.1.2.3"
    # every key is one the connector knows (ConnectorSettings.from_extra refuses others when vLLM starts)
    settings = {k.name for k in source_knobs("vllm_backend.connector_meta", "ConnectorSettings")}
    assert set(extra) <= settings


def test_a_vllm_node_publishes_the_protocol_its_connector_uses() -> None:
    import asyncio
    from types import SimpleNamespace

    from node_runtime.server import node_info
    from vllm_backend.engine import VllmWorker

    vllm_config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=256, dtype="torch.bfloat16"),
                                  cache_config=SimpleNamespace(num_gpu_blocks=64, block_size=16,
                                                               enable_prefix_caching=False, cache_dtype="fp8_e4m3"))
    config = _vllm_node("decode", "rdma")
    worker = VllmWorker(SimpleNamespace(vllm_config=vllm_config), config, asyncio.new_event_loop(), "rdma")
    try:
        info = node_info(config, "m", worker)
    finally:
        worker.loop.close()
    assert (info.engine, info.kv_protocol) == ("vllm", "rdma")
    assert info.kv_cache_dtype == "fp8"  # vLLM's fp8_e4m3 is our fp8 row; its "auto" would be its dtype
