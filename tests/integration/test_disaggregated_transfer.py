"""Prefill on PCP x PP rank processes, KV pulled through Mooncake into a decode engine, decoding on.

The decode engine's blocks must equal the prefill ranks' KV byte for byte, decoding must give the
tokens colocated PCP1 generation gives, and both sides must end with zero used blocks.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from engine_helpers import add_prefilled, fill_from, prefill_held
from pcp2_pp2_handoff import GREEDY, PROMPT

from engine import LLM, SamplingParams
from engine.sequence import Sequence
from kv_transfer.handoff import KVReceiver
from kv_transfer.layout import RequestKV
from kv_transfer.transport import TransferError, register_cache
from kv_transfer.transports.mooncake import MooncakeExporter, MooncakeTransport

KW = dict(dtype="float32", device="cpu", max_model_len=1024)


def _prefill_held(prefill: LLM) -> tuple[Sequence, RequestKV]:
    """Prefill PROMPT as request "r" (first token sampled), its blocks held for the transfer."""
    return prefill_held(prefill.engine, PROMPT)


def _receiver(decode: LLM, timeout_s: float) -> KVReceiver:
    """A Mooncake receiver with the decode engine's cache registered."""
    transport = MooncakeTransport()
    dest = register_cache(transport, decode.engine.executor.cache.layers)
    return KVReceiver(transport, dest, timeout_s=timeout_s)


@pytest.mark.parametrize("layout", ["sharded", "replicated"])
def test_pcp2_pp2_prefill_then_remote_decode_matches_colocated(
        tiny_model, pcp2_pp2_handoffs: Callable[[str], dict[str, Any]], layout) -> None:
    """``pcp2_pp2_handoff.handoff``: prefilled on the ranks, pulled into a decode engine, decoded there."""
    with LLM(str(tiny_model), **KW) as colocated:
        want = colocated.generate([PROMPT], GREEDY)[0].token_ids
    run = pcp2_pp2_handoffs(layout)
    assert run["record"].ok
    assert run["record"].sources == 4  # every (pcp, pp) rank sends: shards fan in, replicas share the bytes
    sent, got = run["sent"], run["got"]
    assert sorted(sent) == sorted(got) == [0, 1, 2]
    for layer in sent:
        assert torch.equal(sent[layer], got[layer]), f"layer {layer} differs after the transfer"
    assert run["released"]
    assert run["output"] == want
    assert run["used_at_end"] == (0, 0)


def test_a_killed_prefill_rank_fails_the_pull_and_leaves_no_blocks(tiny_model) -> None:
    with (
        LLM(str(tiny_model), **KW, pcp=2, cache_exporter=MooncakeExporter()) as prefill,
        LLM(str(tiny_model), **KW) as decode,
    ):
        pe, de = prefill.engine, decode.engine
        seq, request = _prefill_held(prefill)
        receiver = _receiver(decode, timeout_s=5.0)
        fill = fill_from(receiver, "r", request, prefill.cache_exports)
        os.kill(prefill.node.pids()[1], signal.SIGKILL)  # one shard's process dies before the pull
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            add_prefilled(de, PROMPT, seq.output_token_ids[0], SamplingParams(max_tokens=4), fill, request_id="r")
        assert time.monotonic() - t0 < 6
        assert de.num_used_blocks == 0 and not de.has_unfinished()
        assert sum(receiver.stats.failures.values()) == 1
        assert pe.release("r") and pe.num_used_blocks == 0  # the sender's accounting frees too
        receiver.transport.close()


def test_a_prefill_rank_killed_in_the_middle_of_a_large_pull(tmp_path) -> None:
    """About 800 MB in flight from two rank processes when one is SIGKILLed: the pull fails within
    the receiver's timeout and the decode side ends with zero used blocks."""
    from engine.parallel.kv_layout import RankBlocks
    from pdctl.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "m", moe=False, seed=0, overrides={"max_position_embeddings": 131072})
    nblk = 7200  # 7,200 blocks x 3 layers x 16 tokens x 576 x 4 B: 796 MB
    kw = dict(dtype="float32", device="cpu", max_model_len=nblk * 16, num_kv_blocks=nblk + 64)
    with (
        LLM(str(model), **kw, pcp=2, cache_exporter=MooncakeExporter()) as prefill,
        LLM(str(model), **kw) as decode,
    ):
        # The blocks' contents do not matter here, only that they are registered memory of the ranks.
        half = nblk // 2
        holders = [RankBlocks(dp=0, pcp=q, pp=0, rank=q, layers=range(0, 3), logical=list(range(q, nblk, 2)),
                              physical=list(range(half))) for q in (0, 1)]
        receiver = _receiver(decode, timeout_s=20.0)
        fill = fill_from(receiver, "big", RequestKV(holders, nblk), prefill.cache_exports)
        de = decode.engine
        import threading

        killer = threading.Timer(0.15, os.kill, (prefill.node.pids()[1], signal.SIGKILL))
        t0 = time.monotonic()
        killer.start()
        try:
            with pytest.raises(TransferError) as err:
                add_prefilled(de, [5] * (nblk * 16 - 8), 7, SamplingParams(max_tokens=2), fill, request_id="big")
        finally:
            killer.cancel()
        took = time.monotonic() - t0
        assert took > 0.15, "the pull ended before the kill: make it larger"
        assert took < 21
        assert err.value.cause in ("peer_gone", "refused", "timeout")
        assert de.num_used_blocks == 0 and not de.has_unfinished()
        assert receiver.stats.failures[err.value.cause] == 1
        receiver.transport.close()
