"""The transfer planner: every destination block filled once from a holder, fan-in, balance, coalescing.

The plans are executed here by a byte copy between in-process tensors at the planned addresses,
so the test checks real addresses, not just the plan's bookkeeping.
"""

from __future__ import annotations

import pytest
import torch
from transfer_helpers import BS, DIM, marked_caches

from engine.kv_cache import BlockAllocator
from engine.parallel.grid import ParallelConfig
from engine.parallel.kv_layout import ShardedBlockAllocator, kv_ownership
from kv_transfer.layout import RequestKV, describe_cache
from kv_transfer.planner import TransferPlan, arrange_destination, plan_transfer

LAYERS = 4
DEST_BLOCKS = [3, 4, 5, 6, 10, 11, 12, 13, 14]  # two destination runs


def _execute(plan: TransferPlan, caches: dict[int, dict[int, torch.Tensor]], dest: dict[int, torch.Tensor]) -> None:
    for c in plan.copies:
        src, dst = caches[c.source][c.layer], dest[c.layer]
        s0, d0 = c.src_addr - src.data_ptr(), c.dst_addr - dst.data_ptr()
        dst.view(torch.uint8).view(-1)[d0 : d0 + c.nbytes] = src.view(torch.uint8).view(-1)[s0 : s0 + c.nbytes]


def _run(par: ParallelConfig, ids: list[int]) -> tuple[TransferPlan, dict[int, torch.Tensor], list]:
    own = kv_ownership(ids, par, dp=0, num_layers=LAYERS)
    caches = marked_caches(own, 16)
    dest = {i: torch.zeros(20, BS, DIM) for i in range(LAYERS)}
    plan = plan_transfer(
        RequestKV(own, len(ids)),
        {rank: describe_cache(f"prefill-{rank}", layers) for rank, layers in caches.items()},
        describe_cache("decode-0", dest),
        DEST_BLOCKS,
    )
    _execute(plan, caches, dest)
    return plan, dest, own


def _assert_filled(dest: dict[int, torch.Tensor], n: int) -> None:
    for i, t in dest.items():
        for j in range(n):
            assert (t[DEST_BLOCKS[j]] == 1000 * i + j).all(), f"layer {i}, block {j}"
        untouched = [b for b in range(20) if b not in DEST_BLOCKS[:n]]
        assert (t[untouched] == 0).all()


@pytest.mark.parametrize("interleave", [BS, 2 * BS])
def test_sharded_pcp2_pp2_fans_in_from_every_shard(interleave) -> None:
    par = ParallelConfig(pcp=2, pp=2, kv_interleave=interleave)
    ids = ShardedBlockAllocator(16, 2, BS, interleave).allocate(9)
    plan, dest, own = _run(par, ids)
    _assert_filled(dest, 9)
    assert set(plan.by_source()) == {h.rank for h in own}  # every (pcp, pp) rank sends
    assert plan.total_bytes == 9 * LAYERS * BS * DIM * 4
    for c in plan.copies:  # a stage only sends its own layers
        assert c.layer in next(h.layers for h in own if h.rank == c.source)
    # Coalescing: per source, one copy per maximal run of consecutive source and destination ids.
    runs = 0
    for h in (h for h in own if h.pp == 0):
        pairs = list(zip(h.physical, (DEST_BLOCKS[j] for j in h.logical)))
        runs += 1 + sum(1 for (p0, d0), (p1, d1) in zip(pairs, pairs[1:]) if (p1, d1) != (p0 + 1, d0 + 1))
    assert len([c for c in plan.copies if c.layer == 0]) == runs


def test_arranged_destination_makes_one_copy_per_source_and_layer() -> None:
    par = ParallelConfig(pcp=2, pp=2)
    ids = ShardedBlockAllocator(16, 2, BS, BS).allocate(9)  # blocks alternate between the shards
    own = kv_ownership(ids, par, dp=0, num_layers=LAYERS)
    request = RequestKV(own, 9)
    dest_blocks = arrange_destination(request, list(range(11, 20)))
    assert sorted(dest_blocks) == list(range(11, 20))
    caches = marked_caches(own, 16)
    dest = {i: torch.zeros(20, BS, DIM) for i in range(LAYERS)}
    layouts = {rank: describe_cache(f"p{rank}", layers) for rank, layers in caches.items()}
    plan = plan_transfer(request, layouts, describe_cache("d", dest), dest_blocks)
    assert len(plan.copies) == 2 * LAYERS  # one per (source shard, layer) instead of one per block
    _execute(plan, caches, dest)
    for i, t in dest.items():
        for j in range(9):
            assert (t[dest_blocks[j]] == 1000 * i + j).all()


def test_replicated_spreads_bytes_evenly_over_replicas() -> None:
    par = ParallelConfig(pcp=2, pp=2, kv_layout="replicated")
    ids = BlockAllocator(16).allocate(9)
    plan, dest, own = _run(par, ids)
    _assert_filled(dest, 9)
    sent = plan.bytes_by_source()
    assert set(sent) == {h.rank for h in own}
    block_bytes = BS * DIM * 4
    for pp in (0, 1):
        stage = [h for h in own if h.pp == pp]
        a, b = (sent[h.rank] for h in stage)
        assert abs(a - b) <= block_bytes * len(stage[0].layers)  # at most one block (of each layer) apart


def test_plan_refuses_what_cannot_be_moved() -> None:
    par = ParallelConfig(pcp=2)
    ids = ShardedBlockAllocator(16, 2, BS, BS).allocate(4)
    own = kv_ownership(ids, par, dp=0, num_layers=2)
    caches = marked_caches(own, 16)
    layouts = {r: describe_cache(f"p{r}", layers) for r, layers in caches.items()}
    dest = describe_cache("d", {i: torch.zeros(8, BS, DIM) for i in range(2)})
    with pytest.raises(ValueError, match="4 blocks to move but 3"):
        plan_transfer(RequestKV(own, 4), layouts, dest, [0, 1, 2])
    with pytest.raises(ValueError, match="no rank holds logical blocks"):
        RequestKV([h for h in own if h.pcp == 0], 4)
    with pytest.raises(ValueError, match="no cache layout for source rank 1"):
        plan_transfer(RequestKV(own, 4), {0: layouts[0]}, dest, [0, 1, 2, 3])
    wide = describe_cache("d", {i: torch.zeros(8, BS, 2 * DIM) for i in range(2)})
    with pytest.raises(ValueError, match="block sizes must match"):
        plan_transfer(RequestKV(own, 4), layouts, wide, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="outside"):
        plan_transfer(RequestKV(own, 4), layouts, dest, [0, 1, 2, 8])


@pytest.mark.parametrize("source_layers,dest_layers", [(5, 5), (4, 5), (5, 4)],
                         ids=["both-have-it", "source-lacks-it", "dest-lacks-it"])
def test_the_optional_mtp_layer_moves_only_when_both_sides_have_it(source_layers: int, dest_layers: int) -> None:
    """Layer 4 (a 4-layer model's multi-token prediction layer) is optional: copied when both the prefill and
    the decode side hold it, left alone when one lacks it; the stack's layers must be on both sides."""
    ids = [2, 5, 7]
    own = kv_ownership(ids, ParallelConfig(), dp=0, num_layers=source_layers)
    caches = marked_caches(own, 16)
    dest = {i: torch.zeros(20, BS, DIM) for i in range(dest_layers)}
    plan = plan_transfer(RequestKV(own, len(ids)),
                         {rank: describe_cache(f"prefill-{rank}", layers) for rank, layers in caches.items()},
                         describe_cache("decode-0", dest), DEST_BLOCKS, optional=frozenset({LAYERS}))
    _execute(plan, caches, dest)
    assert {c.layer for c in plan.copies} == set(range(min(source_layers, dest_layers)))
    _assert_filled({i: dest[i] for i in range(min(source_layers, dest_layers))}, len(ids))
    if dest_layers > LAYERS and source_layers == LAYERS:
        assert (dest[LAYERS] == 0).all()  # nothing came: the decode side knows from the holders' layers


def test_a_layer_only_one_side_has_is_refused_unless_optional() -> None:
    own = kv_ownership([2, 5], ParallelConfig(), dp=0, num_layers=3)
    layouts = {rank: describe_cache(f"prefill-{rank}", layers) for rank, layers in marked_caches(own, 16).items()}
    with pytest.raises(ValueError, match="holds no cache for layer 2"):
        plan_transfer(RequestKV(own, 2), layouts, describe_cache("d", {i: torch.zeros(8, BS, DIM) for i in range(2)}),
                      [0, 1])
    with pytest.raises(ValueError, match=r"no PP stage holds layers \[3\]"):
        plan_transfer(RequestKV(own, 2), layouts, describe_cache("d", {i: torch.zeros(8, BS, DIM) for i in range(4)}),
                      [0, 1])
