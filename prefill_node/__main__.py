"""``python -m prefill_node --model DIR --node-id ID [--pcp N --pp N --dp N ...]``: a prefill node.

Starts the DP x PCP x PP ranks, registers their KV caches with Mooncake, serves ``PrefillService``
over gRPC and joins the Redis registry. Flags: ``--help`` (generated from the config dataclasses by
``node_runtime.cli``).
"""

from __future__ import annotations

from cluster.proto_gen import pdcluster_v1_pb2_grpc as pb_grpc
from node_runtime import cli as node_cli
from node_runtime import server as node_runtime
from node_runtime.metrics import NodeMetrics
from prefill_node.service import PrefillService
from prefill_node.worker import PrefillWorker


async def main() -> int:
    config, served = node_cli.parse("prefill")
    if config.engine_backend == "vllm":  # imported only here: vLLM is optional
        from vllm_backend import prefill as vllm_worker

        return await vllm_worker.main(config, served)
    worker = PrefillWorker(config, node_runtime.transfer_host(config))
    state = node_runtime.Lifecycle()

    def add(server: object, metrics: NodeMetrics) -> None:
        pb_grpc.add_PrefillServiceServicer_to_server(PrefillService(worker, config.node_id, state, metrics), server)

    return await node_runtime.serve(config, worker, served, add, state)


if __name__ == "__main__":
    node_runtime.run(main)
