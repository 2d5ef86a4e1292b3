"""``python -m decode_node --model DIR --node-id ID [--dp N ...]``: a decode node.

Runs DP decode replicas with continuous batching, pulls each request's KV from the prefill ranks
through Mooncake, serves ``DecodeService`` over gRPC and joins the Redis registry.
"""

from __future__ import annotations

import time

from cluster import node_cli, node_runtime
from cluster.nodes import NodeInfo
from cluster.proto_gen import pdcluster_v1_pb2_grpc as pb_grpc
from decode_node.service import DecodeService
from decode_node.worker import DecodeWorker


async def main() -> int:
    config, served = node_cli.parse("decode")
    if config.engine_backend == "vllm":  # imported only here: vLLM is optional
        from decode_node import vllm_worker

        return await vllm_worker.main(config, served)
    worker = DecodeWorker(config, node_runtime.transfer_host(config))
    state = node_runtime.NodeState()
    ec = config.engine

    def info_for(address: str) -> NodeInfo:
        return NodeInfo(node_id=config.node_id, role="decode", address=address, model=served,
                        max_model_len=worker.max_model_len, dp=ec.dp, pcp=1, pp=1, kv_layout="replicated",
                        block_size=ec.block_size, num_blocks=worker.num_blocks, started_at=time.time())

    def add(server: object) -> None:
        pb_grpc.add_DecodeServiceServicer_to_server(DecodeService(worker, config.node_id, state), server)

    try:
        return await node_runtime.serve(config, worker, info_for, add, state)
    except BaseException:
        worker.shutdown()
        raise


if __name__ == "__main__":
    node_runtime.run(main)
