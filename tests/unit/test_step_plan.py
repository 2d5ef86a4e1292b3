"""Each rank's share of a step plan, with the PCP all-gathers simulated in one process."""

from __future__ import annotations

import pytest
import torch

from engine.parallel.grid import ParallelConfig
from engine.parallel.kv_layout import ShardedBlockAllocator, kv_ownership, local_block_ids
from engine.parallel.step_plan import PlanRow, StepPlan, build_rank_batch, local_token_counts

BS = 4
CPU = torch.device("cpu")


def _gather(parts: list[torch.Tensor], counts: list[int]) -> torch.Tensor:
    """What gather_padded returns, computed locally."""
    if len(parts) == 1:
        return parts[0]
    m = max(counts)
    padded = [torch.cat((p, p.new_full((m - p.shape[0], *p.shape[1:]), -1))) for p in parts]
    return torch.cat(padded)


def _plan(alloc: ShardedBlockAllocator) -> StepPlan:
    """Two decodes (positions 9 and 30), a fresh 23-token prompt, a 13-token chunk after 18 cached."""
    rows = []
    for start, n, logits in [(9, 1, (0, 1)), (30, 1, (0, 1)), (0, 23, (0, 23)), (18, 13, (12, 1))]:
        ids = alloc.allocate(-(-(start + n) // BS))
        rows.append(PlanRow(token_ids=[100 + start + i for i in range(n)], start=start, block_ids=ids, logits=logits))
    return StepPlan(rows)


@pytest.mark.parametrize("pcp,layout", [(1, "sharded"), (3, "sharded"), (2, "replicated"), (4, "sharded")])
def test_rank_shares_cover_the_step_and_gathers_restore_its_order(pcp, layout) -> None:
    par = ParallelConfig(pcp=pcp, kv_layout=layout)
    alloc = ShardedBlockAllocator(64, pcp if layout == "sharded" else 1, BS, BS)
    plan = _plan(alloc)
    batches = [build_rank_batch(plan, par, r, BS, CPU) for r in range(pcp)]
    steps = [b.pcp for b in batches]
    prefills = [row for row in plan.rows if row.num_new > 1]

    # New prefill tokens: every rank's local positions, all-gathered, reordered = the step's positions.
    local_pos = [b.positions[b.num_decode :] for b in batches]
    gathered = _gather(local_pos, steps[0].new_counts)[steps[0].new_index]
    want = torch.cat([row.start + torch.arange(row.num_new) for row in prefills])
    assert torch.equal(gathered, want)
    assert [b.num_tokens for b in batches] == local_token_counts(plan, pcp)

    # Every new position is stored exactly once per holder set: sharded once, replicated on all.
    stores = torch.zeros(want.numel(), dtype=torch.long)
    for st in steps:
        stores[st.new_write_src] += 1
    assert (stores == (1 if layout == "sharded" else pcp)).all()

    # Cached context, read from each rank's fake cache (slot -> position), restores position order.
    caches = []
    for r in range(pcp):
        cache = torch.full((64 * BS,), -1, dtype=torch.long)
        for row in prefills:
            table = torch.tensor(local_block_ids(row.block_ids, par, r))
            pos = torch.arange(row.start)
            held = table[pos // BS] >= 0
            cache[table[pos // BS][held] * BS + pos[held] % BS] = pos[held]
        caches.append(cache)
    reads = [caches[r][st.ctx_read_slots] for r, st in enumerate(steps)]
    ctx = reads[0] if steps[0].ctx_index is None else _gather(reads, steps[0].ctx_counts)[steps[0].ctx_index]
    assert torch.equal(ctx, torch.cat([torch.arange(row.start) for row in prefills]))

    # Logits rows gathered from the ranks come back in plan order.
    rows_pos = [b.positions[b.logits_rows] for b in batches]
    logits_pos = _gather(rows_pos, steps[0].logits_counts)[steps[0].logits_index]
    assert logits_pos.tolist() == [9, 30, *range(23), 30]

    # Each rank's rows' index among the plan's rows (the MTP pass's next tokens): their tokens, every row
    # of the plan once (decode rows on every rank).
    flat = torch.cat([row.token_ids for row in plan.rows])
    seen = torch.zeros(flat.numel(), dtype=torch.long)
    for b in batches:
        mine = b.pcp.plan_rows()
        assert torch.equal(flat[mine], b.input_ids)
        seen[mine] += 1
    assert seen[:2].eq(pcp).all() and seen[2:].eq(1).all()

    # Decode rows: sharded, each cached position is attended by exactly one rank.
    cover = sum(st.dec_mask.long() for st in steps)
    assert cover[0, :10].eq(1 if layout == "sharded" else pcp).all() and not cover[0, 10:].any()


def test_sharded_allocator_places_blocks_on_their_owner() -> None:
    a = ShardedBlockAllocator(num_blocks_per_rank=3, pcp=2, block_size=4, interleave=8)
    ids = a.allocate(5)  # logical blocks 0..4 -> owners 0,0,1,1,0 (8-token runs)
    assert [g % 2 for g in ids] == [0, 0, 1, 1, 0]
    assert a.used_per_rank() == [3, 2]
    assert not a.can_allocate(1, first=5)  # logical 5 -> rank 0, which is full
    assert a.can_allocate(1, first=6)  # logical 6 -> rank 1
    par = ParallelConfig(pcp=2, pp=2, kv_interleave=8)
    own = kv_ownership(ids, par, dp=0, num_layers=3)
    assert [(o.pcp, o.pp, o.logical, list(o.layers)) for o in own] == [
        (0, 0, [0, 1, 4], [0, 1]), (1, 0, [2, 3], [0, 1]), (0, 1, [0, 1, 4], [2]), (1, 1, [2, 3], [2]),
    ]
    # Speculative decoding: the MTP layer's cache (layer 3) on the last stage, beside its own.
    own = kv_ownership(ids, par, dp=0, num_layers=3, mtp_layers=1)
    assert [list(o.layers) for o in own] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    a.free(ids)
    assert a.num_used == 0
    with pytest.raises(ValueError, match="freed twice"):
        a.free(ids[:1])
    with pytest.raises(ValueError, match="multiple of block_size"):
        ShardedBlockAllocator(3, 2, block_size=4, interleave=6)


def test_plan_rejects_decode_rows_after_prefills() -> None:
    with pytest.raises(ValueError, match="decode rows must precede"):
        StepPlan([PlanRow([1, 2], 0, [0], None), PlanRow([3], 5, [1, 2], None)])


def test_busiest_rank_share_of_a_request() -> None:
    from engine.parallel.kv_layout import max_blocks_per_rank

    assert max_blocks_per_rank(80, 16, 2, 64) == 4  # 5 blocks in runs of 4: ranks hold 4 and 1
    assert max_blocks_per_rank(80, 16, 2, 16) == 3
    assert max_blocks_per_rank(16, 16, 4, 16) == 1
