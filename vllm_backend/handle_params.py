"""A native prefill node's ``KVHandle`` as vLLM ``kv_transfer_params`` (native prefill -> vLLM decode).

A native prefill node (any DP x PCP x PP, sharded or replicated KV) answers a ``pb.KVHandle``: per
rank its Mooncake endpoint and layer regions, and which logical blocks it holds where. A vLLM
decode engine running ``PdKVConnector`` reads the request from those holders when its
``kv_transfer_params`` carry the handle under ``pd_handle`` (protobuf's JSON mapping of
``KVHandle``) instead of a producer's side channel (``remote_host``/``remote_port``): the native
sharding is per request, not a layout rule, so the holders travel with the request.

No notification goes back from the connector: the decode node releases the request on the prefill
node (``PrefillService.Release``, as native decode nodes do) once vLLM has produced from it.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from cluster.proto_gen import pdcluster_v1_pb2 as pb
from kv_transfer.handle import KVSource, from_handle

KEY = "pd_handle"


def handle_params(kv: pb.KVHandle, request_id: str, num_tokens: int) -> dict[str, Any]:
    """``kv_transfer_params`` for a vLLM decode of ``request_id`` whose KV ``kv`` describes."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": kv.prefill_node_id,
        "remote_request_id": request_id,
        "remote_num_tokens": num_tokens,
        "transfer_id": f"{kv.prefill_node_id}/{request_id}",
        KEY: json_format.MessageToDict(kv),
    }


def has_handle(params: dict[str, Any]) -> bool:
    return isinstance(params.get(KEY), dict)


def source_of(params: dict[str, Any]) -> KVSource:
    """The planner's view of the handle in ``params``. Raises ValueError on a malformed one."""
    try:
        kv = json_format.ParseDict(params[KEY], pb.KVHandle())
    except (json_format.ParseError, KeyError, TypeError) as e:
        raise ValueError(f"kv_transfer_params[{KEY!r}] is not a KVHandle: {e}") from e
    return from_handle(kv)
