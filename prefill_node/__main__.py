"""``python -m prefill_node --model DIR --node-id ID [--pcp N --pp N --dp N ...]``: a prefill node.

Starts the DP x PCP x PP ranks, registers their KV caches with Mooncake, serves ``PrefillService``
over gRPC and joins the Redis registry. Flags: ``--help`` (defaults from ``cluster.config``).
"""

from __future__ import annotations

import time

from cluster import node_cli, node_runtime
from cluster.nodes import NodeInfo
from cluster.proto_gen import pdcluster_v1_pb2_grpc as pb_grpc
from prefill_node.service import PrefillService
from prefill_node.worker import PrefillWorker


async def main() -> int:
    config, served = node_cli.parse("prefill")
    if config.engine_backend == "vllm":  # imported only here: vLLM is optional
        from prefill_node import vllm_worker

        return await vllm_worker.main(config, served)
    worker = PrefillWorker(config, node_runtime.transfer_host(config))
    state = node_runtime.NodeState()
    ec = config.engine

    def info_for(address: str) -> NodeInfo:
        worker.address = address
        return NodeInfo(node_id=config.node_id, role="prefill", address=address, model=served,
                        max_model_len=worker.max_model_len, dp=ec.dp, pcp=ec.pcp, pp=ec.pp, kv_layout=ec.kv_layout,
                        block_size=ec.block_size, num_blocks=worker.num_blocks, started_at=time.time())

    def add(server: object) -> None:
        pb_grpc.add_PrefillServiceServicer_to_server(PrefillService(worker, config.node_id, state), server)

    try:
        return await node_runtime.serve(config, worker, info_for, add, state)
    except BaseException:
        worker.shutdown()
        raise


if __name__ == "__main__":
    node_runtime.run(main)
