"""Transfer faults between a prefill engine and a decode engine (fake transport, in process).

Each case ends with zero used blocks on both sides: the decode side frees when the pull fails,
the prefill side when its lease is confirmed, aborted or expires.
"""

from __future__ import annotations

import pytest
from engine_helpers import add_prefilled, fill_from

from engine import LLM, SamplingParams
from kv_transfer.handoff import KVReceiver, KVSender
from kv_transfer.layout import RequestKV, describe_cache
from kv_transfer.transport import TransferError
from kv_transfer.transports.fake import Fabric

KW = dict(dtype="float32", device="cpu", max_model_len=512)
PROMPT = [(i * 5 + 1) % 900 + 2 for i in range(100)]


@pytest.fixture()
def pair(tiny_model):
    """A prefill engine holding one request's KV under a lease, and a decode engine with a receiver."""
    now = [0.0]
    with LLM(str(tiny_model), **KW) as pre, LLM(str(tiny_model), **KW) as dec:
        pe, de = pre.engine, dec.engine
        seq = pe.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=0.0), request_id="r", hold_kv=True)
        while pe.has_unfinished():
            pe.step()
        fabric = Fabric()
        src = describe_cache("prefill", pe.executor.cache.layers)
        fabric.transport("prefill").register(src)
        dst = describe_cache("decode", de.executor.cache.layers)
        t = fabric.transport("decode")
        t.register(dst)
        leases = KVSender(pe.release, lease_s=30.0, clock=lambda: now[0])
        leases.hold("r")
        request = RequestKV(pe.kv_ownership("r"), len(pe.held["r"].block_ids))
        receiver = KVReceiver(t, dst, timeout_s=0.5)
        fill = fill_from(receiver, "r", request, {0: src})
        yield pe, de, fabric, leases, receiver, fill, seq.output_token_ids[0], now


def _admit(de, first, fill):
    return add_prefilled(de, PROMPT, first, SamplingParams(max_tokens=4, temperature=0.0), fill, request_id="r")


def test_success_records_the_transfer_and_confirm_frees_the_sender(pair) -> None:
    pe, de, fabric, leases, receiver, fill, first, _ = pair
    _admit(de, first, fill)
    assert leases.confirm("r")
    while de.has_unfinished():
        de.step()
    rec = receiver.stats.recent[-1]
    assert rec.ok and rec.bytes == fabric.bytes_moved > 0 and rec.gbps > 0
    assert pe.num_used_blocks == 0 and de.num_used_blocks == 0


@pytest.mark.parametrize("fault", ["peer_gone", "timeout", "refused"])
def test_a_failed_pull_frees_the_receiver_and_the_lease_frees_the_sender(pair, fault) -> None:
    pe, de, fabric, leases, receiver, fill, first, now = pair
    if fault == "peer_gone":
        fabric.kill("prefill")
    elif fault == "timeout":
        fabric.delay_s = 1.0
    else:
        fabric.fail_next("prefill", "refused")
    with pytest.raises(TransferError):
        _admit(de, first, fill)
    assert de.num_used_blocks == 0 and not de.has_unfinished()
    assert receiver.stats.failures[fault] == 1
    assert pe.num_used_blocks > 0  # the decode side never confirmed ...
    now[0] = 30.0
    assert leases.expire() == ["r"]  # ... so the lease runs out
    assert pe.num_used_blocks == 0


def test_abort_frees_both_sides(pair) -> None:
    pe, de, _, leases, _, fill, first, _ = pair
    _admit(de, first, fill)
    assert de.abort("r") and leases.abort("r")
    assert pe.num_used_blocks == 0 and de.num_used_blocks == 0
