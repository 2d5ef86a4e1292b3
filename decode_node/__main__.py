"""``python -m decode_node --model DIR --node-id ID [--dp N ...]``: a decode node.

Runs DP decode replicas with continuous batching, pulls each request's KV from the prefill ranks
through Mooncake, serves ``DecodeService`` over gRPC and joins the Redis registry.
"""

from __future__ import annotations

from cluster.proto_gen import pdcluster_v1_pb2_grpc as pb_grpc
from decode_node.service import DecodeService
from decode_node.worker import DecodeWorker
from node_runtime import cli as node_cli
from node_runtime import server as node_runtime
from node_runtime.metrics import NodeMetrics


async def main() -> int:
    config, served = node_cli.parse("decode")
    if config.engine_backend == "vllm":  # imported only here: vLLM is optional
        from vllm_backend import decode as vllm_worker

        return await vllm_worker.main(config, served)
    worker = DecodeWorker(config, node_runtime.transfer_host(config))
    state = node_runtime.Lifecycle()

    def add(server: object, metrics: NodeMetrics) -> None:
        pb_grpc.add_DecodeServiceServicer_to_server(DecodeService(worker, config.node_id, state, metrics), server)

    return await node_runtime.serve(config, worker, served, add, state)


if __name__ == "__main__":
    node_runtime.run(main)
