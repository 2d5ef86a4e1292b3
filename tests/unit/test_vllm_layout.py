"""vLLM's PCP/DCP KV layout as planner holders (no vLLM import).

Each source rank's cache is filled the way vLLM's rule says it is: position ``i`` lives on the
DCP rank with ``(i // interleave) % dcp == dcp_rank``, and each rank stores its positions of one
virtual block in order in that block's slots. The plan built from ``holders`` is then executed as
byte copies at the planned addresses, and the destination (DCP = 1, or a DCP shard) must hold
every position's value in vLLM's order.
"""

from __future__ import annotations

import pytest
import torch

from kv_transfer.layout import describe_cache, restrict
from kv_transfer.planner import TransferPlan, plan_transfer
from vllm_backend.layout import (
    VllmKVLayout,
    holders,
    spread_replicas,
    transfer_unit,
    unit_layout,
    units_of,
)

DIM = 8  # stands in for kv_lora_rank + qk_rope_head_dim
LAYERS = 2


def _reference_slots(lay: VllmKVLayout, pcp: int, tp: int, block_ids: list[int], n: int) -> dict[int, int]:
    """Position -> slot on rank (pcp, tp), from the rule as stated (not from ``VllmKVLayout.slot``)."""
    me = (tp * lay.pcp + pcp) % lay.dcp
    out: dict[int, int] = {}
    vbs = lay.block_size * lay.dcp
    for vb in range(-(-n // vbs)):
        mine = [i for i in range(vb * vbs, (vb + 1) * vbs) if (i // lay.interleave) % lay.dcp == me]
        for k, i in enumerate(mine):  # a rank stores its positions of a virtual block in order
            if i < n:
                out[i] = block_ids[vb] * lay.block_size + k
    return out


def _source_caches(
    lay: VllmKVLayout, block_ids: list[int], n: int, num_blocks: int
) -> dict[int, dict[int, torch.Tensor]]:
    """Per worker rank, per layer, a cache whose slot for position i holds 1000·layer + i + 1."""
    caches = {}
    for rank in range(lay.world_size):
        _, pcp, tp = lay.coords(rank)
        layers = {}
        for layer in range(LAYERS):
            t = torch.full((num_blocks, lay.block_size, DIM), -1.0)
            for i, s in _reference_slots(lay, pcp, tp, block_ids, n).items():
                t.view(-1, DIM)[s] = 1000 * layer + i + 1
            layers[layer] = t
        caches[rank] = layers
    return caches


def _execute(plan: TransferPlan, caches: dict[int, dict[int, torch.Tensor]], dest: dict[int, torch.Tensor]) -> None:
    for c in plan.copies:
        src, dst = caches[c.source][c.layer], dest[c.layer]
        s0, d0 = c.src_addr - src.data_ptr(), c.dst_addr - dst.data_ptr()
        dst.view(torch.uint8).view(-1)[d0 : d0 + c.nbytes] = src.view(torch.uint8).view(-1)[s0 : s0 + c.nbytes]


def _transfer(src: VllmKVLayout, dst: VllmKVLayout, n: int, dst_pcp: int = 0, dst_tp: int = 0,
              spread: bool = False) -> tuple[TransferPlan, dict[int, torch.Tensor], list[int]]:
    src_ids = [7, 2, 9, 4, 0, 5, 8, 1][: -(-n // src.virtual_block_size)]
    dst_ids = [3, 6, 1, 8, 0, 2, 5, 7, 4][: -(-n // dst.virtual_block_size)]
    caches = _source_caches(src, src_ids, n, num_blocks=10)
    dest = {layer: torch.full((10, dst.block_size, DIM), -1.0) for layer in range(LAYERS)}
    unit = transfer_unit(src, dst)
    hs = holders(src, src_ids, 0, n, unit, {r: range(LAYERS) for r in range(src.world_size)})
    if spread:
        hs = spread_replicas(hs)
    wanted = units_of(dst, dst_pcp, dst_tp, dst_ids, 0, n, unit)
    request = restrict(hs, [j for j, _ in wanted])
    sources = {r: unit_layout(describe_cache(f"p{r}", caches[r]), src.block_size, unit) for r in caches}
    plan = plan_transfer(request, sources, unit_layout(describe_cache("d", dest), dst.block_size, unit),
                         [u for _, u in wanted])
    _execute(plan, caches, dest)
    return plan, dest, dst_ids


def _check(dst: VllmKVLayout, dest: dict[int, torch.Tensor], dst_ids: list[int], n: int,
           dst_pcp: int = 0, dst_tp: int = 0) -> None:
    slots = _reference_slots(dst, dst_pcp, dst_tp, dst_ids, n)
    assert slots, "the destination holds no position"
    for layer, t in dest.items():
        for i, s in slots.items():
            assert t.view(-1, DIM)[s, 0].item() == 1000 * layer + i + 1, (layer, i)


@pytest.mark.parametrize("kw", [
    dict(pcp=2, dcp=1, block_size=4),
    dict(pcp=2, dcp=2, block_size=4, interleave=1),
    dict(pcp=2, dcp=2, block_size=4, interleave=4),
    dict(tp=2, pcp=2, dcp=4, block_size=4, interleave=2),
    dict(tp=2, dcp=2, block_size=8, interleave=2),
])
def test_slots_follow_vllm_rule(kw):
    lay = VllmKVLayout(**kw)
    ids = [5, 1, 3]
    n = 3 * lay.virtual_block_size - 1
    for rank in range(lay.world_size):
        _, pcp, tp = lay.coords(rank)
        ref = _reference_slots(lay, pcp, tp, ids, n)
        ours = {i: lay.slot(i, ids) for i in range(n) if lay.owner(i) == lay.dcp_rank(pcp, tp)}
        assert ours == ref
        # the statement of the rule: (i // interleave) % dcp == dcp_rank
        assert all((i // lay.interleave) % lay.dcp == lay.dcp_rank(pcp, tp) for i in ours)


def test_dcp_groups_match_vllm():
    assert [VllmKVLayout(pcp=2, dcp=2).dcp_rank(p, 0) for p in range(2)] == [0, 1]
    lay = VllmKVLayout(tp=2, pcp=2, dcp=4)
    assert sorted(lay.dcp_rank(p, t) for p in range(2) for t in range(2)) == [0, 1, 2, 3]
    assert lay.dcp_rank(1, 0) == 1 and lay.dcp_rank(0, 1) == 2  # PCP innermost
    assert [VllmKVLayout(tp=4, dcp=2).dcp_rank(0, t) for t in range(4)] == [0, 1, 0, 1]
    assert VllmKVLayout(tp=2, pcp=2).rank(pp=0, pcp=1, tp=0) == 2


@pytest.mark.parametrize("kw", [dict(tp=3, dcp=2), dict(pcp=2, dcp=3), dict(block_size=6, interleave=4)])
def test_invalid_layouts_rejected(kw):
    with pytest.raises(ValueError):
        VllmKVLayout(**kw)


def test_pcp2_dcp1_replicas_spread_evenly():
    src, dst = VllmKVLayout(pcp=2, dcp=1, block_size=4), VllmKVLayout(block_size=4)
    n = 6 * 4 - 1
    hs = holders(src, [7, 2, 9, 4, 0, 5], 0, n, transfer_unit(src, dst), {0: range(2), 1: range(2)})
    assert hs[0].logical == hs[1].logical == list(range(6))  # full replicas
    plan, dest, ids = _transfer(src, dst, n)
    _check(dst, dest, ids, n)
    per = plan.bytes_by_source()
    assert set(per) == {0, 1} and per[0] == per[1]


@pytest.mark.parametrize("interleave", [1, 2, 4])
def test_pcp2_dcp2_fans_in_from_both_shards(interleave):
    src, dst = VllmKVLayout(pcp=2, dcp=2, block_size=4, interleave=interleave), VllmKVLayout(block_size=4)
    n = 3 * 8 - 3
    plan, dest, ids = _transfer(src, dst, n)
    _check(dst, dest, ids, n)
    assert set(plan.bytes_by_source()) == {0, 1}


def test_block_interleave_moves_whole_blocks():
    src, dst = VllmKVLayout(pcp=2, dcp=2, block_size=4, interleave=4), VllmKVLayout(block_size=4)
    assert transfer_unit(src, dst) == 4
    plan, _, _ = _transfer(src, dst, 16)
    assert all(c.nbytes % (4 * DIM * 4) == 0 for c in plan.copies)


@pytest.mark.parametrize("spread", [False, True])
def test_tp2_pcp2_dcp4(spread):
    src = VllmKVLayout(tp=2, pcp=2, dcp=4, block_size=4, interleave=2)
    dst = VllmKVLayout(block_size=4)
    n = 2 * 16 - 5
    plan, dest, ids = _transfer(src, dst, n, spread=spread)
    _check(dst, dest, ids, n)
    assert set(plan.bytes_by_source()) == {0, 1, 2, 3}  # four shards, no replicas


def test_tp2_dcp1_replicas_spread_with_spread_replicas():
    src, dst = VllmKVLayout(tp=2, pcp=2, dcp=2, block_size=4, interleave=1), VllmKVLayout(block_size=4)
    n = 4 * 8
    plan, dest, ids = _transfer(src, dst, n)
    _check(dst, dest, ids, n)
    plan_s, dest_s, ids_s = _transfer(src, dst, n, spread=True)
    _check(dst, dest_s, ids_s, n)
    # DCP shards alternate every position: without spreading, each shard's first replica sends all
    assert len(plan.bytes_by_source()) == 2
    assert len(plan_s.bytes_by_source()) == 4


@pytest.mark.parametrize("dst_pcp", [0, 1])
def test_into_a_dcp_sharded_destination(dst_pcp):
    src = VllmKVLayout(tp=2, pcp=2, dcp=4, block_size=4, interleave=2)
    dst = VllmKVLayout(pcp=2, dcp=2, block_size=8, interleave=1)
    n = 40
    _, dest, ids = _transfer(src, dst, n, dst_pcp=dst_pcp)
    _check(dst, dest, ids, n, dst_pcp=dst_pcp)


def test_partial_range_skips_local_prefix():
    lay = VllmKVLayout(block_size=4)
    assert [j for j, _ in units_of(lay, 0, 0, [3, 1, 2], 4, 10, 4)] == [1, 2]
    with pytest.raises(ValueError):
        units_of(lay, 0, 0, [3, 1, 2], 2, 10, 4)


@pytest.mark.parametrize("native, dst", [
    (dict(pcp=2, pp=2, kv_layout="sharded"), VllmKVLayout(block_size=8)),  # vLLM blocks 2x native's
    (dict(pcp=2, pp=1, kv_layout="sharded", kv_interleave=8), VllmKVLayout(block_size=2)),
    (dict(pcp=2, pp=1, kv_layout="replicated"), VllmKVLayout(block_size=4)),
    (dict(pcp=2, pp=1, kv_layout="sharded"), VllmKVLayout(tp=2, dcp=2, block_size=4, interleave=2)),
])
def test_native_prefill_holders_into_vllm(native, dst):
    """A native DP x PCP x PP prefill (the node's own ``kv_ownership``) read into a vLLM cache."""
    from engine.parallel.grid import ParallelConfig
    from engine.parallel.kv_layout import kv_ownership, local_block_ids
    from vllm_backend.layout import native_units

    bs, n, layers = 4, 21, set(range(LAYERS))
    par = ParallelConfig(dp=1, **native)
    owner_of = [(j // (par.interleave(bs) // bs)) % par.pcp for j in range(-(-n // bs))]
    phys = [3, 0, 5, 1, 4, 2]
    gids = phys[: len(owner_of)] if par.kv_layout == "replicated" else \
        [phys[j] * par.pcp + o for j, o in enumerate(owner_of)]
    hs = kv_ownership(gids, par, dp=0, num_layers=LAYERS)
    caches = {}  # per rank, per layer of its stage: slot of position i holds 1000·layer + i + 1
    for h in hs:
        local = local_block_ids(gids, par, h.pcp)
        caches[h.rank] = {}
        for layer in h.layers:
            t = torch.full((8, bs, DIM), -1.0)
            for i in range(n):
                if local[i // bs] >= 0:
                    t[local[i // bs], i % bs] = 1000 * layer + i + 1
            caches[h.rank][layer] = t
    unit = transfer_unit(VllmKVLayout(block_size=bs), dst)
    units = spread_replicas(native_units(hs, bs, unit, 0, n, layers))
    dst_ids = [4, 1, 6, 0, 2, 5, 3, 11, 9, 7, 10, 8][: -(-n // dst.virtual_block_size)]
    sources = {r: unit_layout(describe_cache(f"p{r}", c), bs, unit) for r, c in caches.items()}
    for tp in range(dst.tp):  # every destination worker reads what it holds
        dest = {layer: torch.full((12, dst.block_size, DIM), -1.0) for layer in layers}
        wanted = units_of(dst, 0, tp, dst_ids, 0, n, unit)
        plan = plan_transfer(restrict(units, [j for j, _ in wanted]), sources,
                             unit_layout(describe_cache("d", dest), dst.block_size, unit), [u for _, u in wanted])
        _execute(plan, caches, dest)
        _check(dst, dest, dst_ids, n, dst_tp=tp)
        if par.kv_layout == "replicated":  # both PCP replicas serve
            assert set(plan.bytes_by_source()) == {0, 1}
    # A range starting after a local prefix leaves the prefix's units out.
    assert all(j >= 8 // unit for h in native_units(hs, bs, unit, 8, n, layers) for j in h.logical)
