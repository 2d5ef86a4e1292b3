"""vLLM's KV events, as a --engine vllm node reads them, become our block hashes (as the proxy computes them)."""

from __future__ import annotations

import time

import pytest

from engine.block_hash import prompt_block_hashes
from vllm_backend.kv_events import KVEventTranslator, VllmKVEvents

kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="vllm is not importable (scripts/test_vllm.sh)")
AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch = (
    kv_events.AllBlocksCleared, kv_events.BlockRemoved, kv_events.BlockStored, kv_events.KVEventBatch)

TOKENS = list(range(100, 164))  # four blocks of 16


def stored(hashes: list[bytes], parent: bytes | None, tokens: list[int]) -> object:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=16, lora_id=None,
                       medium="GPU", lora_name=None)


def test_stored_blocks_chain_into_our_hashes_and_removals_follow() -> None:
    ours = prompt_block_hashes(TOKENS, 16)
    t = KVEventTranslator()
    t.apply([stored([b"a", b"b"], None, TOKENS[:32]), stored([b"c"], b"b", TOKENS[32:48])])
    assert t.take() == (ours[:3], [])
    t.apply([stored([b"x"], b"unknown", TOKENS[48:64])])  # a parent never seen: nothing to chain from
    t.apply([BlockRemoved(block_hashes=[b"c", b"never"], medium="GPU")])
    assert t.take() == ([], [ours[2]])
    t.apply([AllBlocksCleared()])
    assert sorted(t.take()[1]) == sorted(ours[:2])


def test_the_node_reads_a_zmq_publisher_like_vllms(tmp_path) -> None:
    import msgspec
    import zmq

    endpoint = f"ipc://{tmp_path / 'kv-events'}"
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(endpoint)
    relay = VllmKVEvents(endpoint)
    try:
        batch = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=[stored([b"a"], None, TOKENS[:16])]))
        deadline = time.monotonic() + 10
        got: tuple[list[int], list[int]] = ([], [])
        while not got[0] and time.monotonic() < deadline:  # ZMQ drops what is sent before the subscriber joins
            pub.send_multipart((b"", (0).to_bytes(8, "big"), batch))
            time.sleep(0.1)
            got = relay.take()
        assert got == (prompt_block_hashes(TOKENS[:16], 16), [])
    finally:
        relay.close()
        pub.close()
