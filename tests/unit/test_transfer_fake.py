"""A plan moved by the fake transport (real byte copies), its faults, and leases."""

from __future__ import annotations

import pytest
import torch
from transfer_helpers import BS, DIM, marked_caches

from engine import LLM, SamplingParams
from engine.parallel.grid import ParallelConfig
from engine.parallel.kv_layout import ShardedBlockAllocator, kv_ownership
from kv_transfer.handoff import KVSender
from kv_transfer.layout import RequestKV, describe_cache
from kv_transfer.planner import plan_transfer
from kv_transfer.transport import Segment, TransferError
from kv_transfer.transports.fake import Fabric


@pytest.fixture()
def setup():
    """PCP2 x PP2 sharded sources holding 6 blocks (value 1000·layer + block), a decode destination."""
    par = ParallelConfig(pcp=2, pp=2)
    ids = ShardedBlockAllocator(8, 2, BS, BS).allocate(6)
    own = kv_ownership(ids, par, dp=0, num_layers=2)
    fabric = Fabric()
    layouts = {}
    caches = marked_caches(own, 8)
    for h in own:
        layouts[h.rank] = describe_cache(f"prefill-{h.rank}", caches[h.rank])
        fabric.transport(layouts[h.rank].endpoint).register(layouts[h.rank])
    dest = {i: torch.zeros(10, BS, DIM) for i in range(2)}
    dest_layout = describe_cache("decode-0", dest)
    receiver = fabric.transport("decode-0")
    receiver.register(dest_layout)
    plan = plan_transfer(RequestKV(own, 6), layouts, dest_layout, [2, 3, 4, 5, 6, 7])
    return fabric, receiver, plan, layouts, dest, caches


def _pull(receiver, plan, layouts, timeout_s: float = 5.0) -> None:
    for src, segments in plan.pull_segments().items():
        receiver.read(layouts[src].endpoint, segments, timeout_s)


def test_decode_pulls_every_shard_byte_exact(setup) -> None:
    fabric, receiver, plan, layouts, dest, _ = setup
    _pull(receiver, plan, layouts)
    for i, t in dest.items():
        for j in range(6):
            assert (t[2 + j] == 1000 * i + j).all()
        assert (t[[0, 1, 8, 9]] == 0).all()
    assert fabric.bytes_moved == plan.total_bytes == 6 * 2 * BS * DIM * 4
    assert len(plan.pull_segments()) == 4  # fan-in from all (pcp, pp) ranks


def test_faults_raise_with_their_cause_and_copy_nothing_out_of_bounds(setup) -> None:
    fabric, receiver, plan, layouts, dest, caches = setup
    src, segments = next(iter(plan.pull_segments().items()))
    peer = layouts[src].endpoint
    fabric.fail_next(peer, "refused")
    with pytest.raises(TransferError, match="refused") as e:
        receiver.read(peer, segments, 1.0)
    assert e.value.cause == "refused"
    receiver.read(peer, segments, 1.0)  # the fault was one-shot
    fabric.delay_s = 0.2
    with pytest.raises(TransferError) as e:
        receiver.read(peer, segments, timeout_s=0.1)
    assert e.value.cause == "timeout"
    fabric.delay_s = 0.0
    base = caches[src][next(iter(caches[src]))].data_ptr()
    with pytest.raises(TransferError) as e:  # past the end of the source's registered cache
        receiver.read(peer, [Segment(dest[0].data_ptr(), base + 8 * BS * DIM * 4 - 4, 8)], 1.0)
    assert e.value.cause == "not_registered"
    fabric.kill(peer)
    with pytest.raises(TransferError) as e:
        receiver.read(peer, segments, 1.0)
    assert e.value.cause == "peer_gone"


def test_leases_free_held_blocks_on_confirm_abort_and_expiry(tiny_model) -> None:
    now = [0.0]
    with LLM(str(tiny_model), dtype="float32", device="cpu", max_model_len=256) as llm:
        eng = llm.engine
        for rid in ("a", "b", "c"):
            eng.add_request([5, 6, 7, 8] * 10, SamplingParams(max_tokens=1), request_id=rid, hold_kv=True)
        while eng.has_unfinished():
            eng.step()
        held = eng.num_used_blocks
        assert held > 0 and sorted(eng.held) == ["a", "b", "c"]
        leases = KVSender(eng.release, lease_s=30.0, clock=lambda: now[0])
        for rid in ("a", "b", "c"):
            leases.hold(rid)
        assert leases.confirm("a") and not leases.confirm("a")
        assert leases.abort("b")
        now[0] = 29.9
        assert leases.expire() == [] and eng.num_used_blocks == held // 3
        now[0] = 30.0
        assert leases.expire() == ["c"] and leases.expired_total == 1
        assert eng.num_used_blocks == 0 and not eng.held and len(leases) == 0


def test_a_lease_ends_once_whichever_of_take_confirm_abort_or_expiry_comes_first() -> None:
    freed: list[str] = []
    now = [0.0]
    leases = KVSender(freed.append, lease_s=10.0, clock=lambda: now[0])
    leases.hold("taken")
    leases.hold("late")
    assert leases.take("taken") and "taken" not in leases  # ended, nothing freed: the caller frees later
    assert not leases.take("taken") and not leases.confirm("taken") and not leases.abort("taken")
    now[0] = 11.0
    assert leases.expire() == ["late"]  # a taken lease cannot run out
    assert freed == ["late"] and not leases.take("late") and len(leases) == 0
