"""Command-line flags of the node processes (``python -m prefill_node`` / ``python -m decode_node``).

Defaults come from ``EngineConfig`` and ``NodeConfig``, so a flag and its dataclass never disagree.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster.config import NodeConfig, RegistryConfig
from engine.engine_config import EngineConfig

_E = EngineConfig.__dataclass_fields__
_N = NodeConfig.__dataclass_fields__
_R = RegistryConfig.__dataclass_fields__


def _default(fields: dict, name: str) -> object:
    f = fields[name]
    return f.default


def parser(role: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"python -m {role}_node", description=f"pdcluster {role} node (gRPC)")
    ap.add_argument("--model", required=True, help="model directory (Hugging Face format)")
    ap.add_argument("--served-model-name", default=None,
                    help="the model name clients use (default: the directory's name)")
    ap.add_argument("--node-id", required=True, help="unique within the cluster, e.g. prefill-0")
    ap.add_argument("--host", default=_default(_N, "host"), help="gRPC listen address")
    ap.add_argument("--port", type=int, default=_default(_N, "port"), help="gRPC port (0 = a free one)")
    ap.add_argument("--advertise-host", default=None,
                    help="the host name others dial, for gRPC and the KV transport (default: --host)")
    ap.add_argument("--registry-url", default=_default(_R, "url"))
    ap.add_argument("--cluster", default=_default(_R, "cluster"), help="registry key prefix")
    ap.add_argument("--heartbeat-s", type=float, default=_default(_R, "heartbeat_s"))
    ap.add_argument("--ttl-s", type=float, default=_default(_R, "ttl_s"))
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    if role == "prefill":
        ap.add_argument("--pcp", type=int, default=1, help="prefill context parallel size")
        ap.add_argument("--pp", type=int, default=1, help="pipeline stages")
        ap.add_argument("--kv-layout", choices=["sharded", "replicated"], default=_default(_E, "kv_layout"))
        ap.add_argument("--kv-interleave", type=int, default=None)
        ap.add_argument("--lease-s", type=float, default=_default(_N, "lease_s"),
                        help="how long a finished prefill keeps its KV for the decode side")
    else:
        ap.add_argument("--transfer-timeout-s", type=float, default=_default(_N, "transfer_timeout_s"))
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size (--engine vllm only)")
    ap.add_argument("--dcp", type=int, default=1, help="decode context parallel size (--engine vllm only)")
    ap.add_argument("--dtype", default=_default(_E, "dtype"))
    ap.add_argument("--device", default=_default(_E, "device"))
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=_default(_E, "max_num_batched_tokens"))
    ap.add_argument("--max-num-seqs", type=int, default=_default(_E, "max_num_seqs"))
    ap.add_argument("--block-size", type=int, default=_default(_E, "block_size"))
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=_default(_E, "gpu_memory_utilization"))
    ap.add_argument("--load-format", default=_default(_E, "load_format"))
    ap.add_argument("--seed", type=int, default=_default(_E, "seed"))
    ap.add_argument("--engine", choices=["native", "vllm"], default=_default(_N, "engine_backend"),
                    help="native: pdcluster's engine; vllm: an in-process vLLM engine with PdKVConnector "
                         "(needs vllm importable; DP 1, --tp/--dcp/--pcp/--pp)")
    ap.add_argument("--grace-s", type=float, default=_default(_N, "grace_s"),
                    help="on SIGTERM, how long in-flight requests may finish")
    return ap


def parse(role: str, argv: list[str] | None = None) -> tuple[NodeConfig, str]:
    """Flags -> (NodeConfig, served model name). Invalid values exit with the parser's error."""
    ap = parser(role)
    a = ap.parse_args(argv)
    try:
        engine = EngineConfig(
            model=a.model, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len,
            max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs, block_size=a.block_size,
            num_kv_blocks=a.num_kv_blocks, gpu_memory_utilization=a.gpu_memory_utilization,
            load_format=a.load_format, seed=a.seed, dp=a.dp,
            pcp=getattr(a, "pcp", 1), pp=getattr(a, "pp", 1),
            kv_layout=getattr(a, "kv_layout", _default(_E, "kv_layout")),
            kv_interleave=getattr(a, "kv_interleave", None),
        )
        node = NodeConfig(
            role=role, node_id=a.node_id, engine=engine, host=a.host, port=a.port, advertise_host=a.advertise_host,
            registry=RegistryConfig(url=a.registry_url, cluster=a.cluster, ttl_s=a.ttl_s, heartbeat_s=a.heartbeat_s),
            lease_s=getattr(a, "lease_s", _default(_N, "lease_s")),
            transfer_timeout_s=getattr(a, "transfer_timeout_s", _default(_N, "transfer_timeout_s")),
            grace_s=a.grace_s, engine_backend=a.engine, tp=a.tp, dcp=a.dcp,
        )
    except ValueError as e:
        ap.error(str(e))
    if not Path(a.model, "config.json").is_file():
        ap.error(f"--model {a.model}: no config.json there")
    return node, a.served_model_name or Path(a.model).resolve().name
