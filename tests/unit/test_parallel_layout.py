"""Rank grid, PP stage ranges, the zigzag PCP split and sharded KV placement."""

from __future__ import annotations

import pytest

from engine.parallel.grid import ParallelConfig, stage_layers
from engine.parallel.pcp_split import kv_owner, owned_logical_blocks, zigzag_indices


def test_rank_order_matches_vllm() -> None:
    pc = ParallelConfig(dp=2, pp=2, pcp=2)
    assert pc.world_size == 8
    # rank = ((dp * PP + pp) * PCP + pcp) * TP + tp
    assert [pc.rank(d, p, c) for d in range(2) for p in range(2) for c in range(2)] == list(range(8))
    for r in range(8):
        c = pc.coord(r)
        assert pc.rank(c.dp, c.pp, c.pcp, c.tp) == r
    assert pc.pcp_group(5) == [4, 5]
    assert pc.pp_group(5) == [5, 7]
    assert pc.all_pcp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert pc.all_pp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert pc.replica_ranks(1) == [4, 5, 6, 7]
    # EP: a PP stage's DP x PCP ranks, DP-major (vLLM's flattening: ep_rank = dp * PCP + pcp)
    assert pc.all_ep_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert pc.ep_group(6) == [2, 3, 6, 7]
    assert [pc.ep_rank(r) for r in pc.ep_group(6)] == [0, 1, 2, 3]


def test_parallel_config_validation() -> None:
    with pytest.raises(ValueError, match="pcp must be >= 1"):
        ParallelConfig(pcp=0)
    with pytest.raises(ValueError, match="kv_layout"):
        ParallelConfig(kv_layout="striped")
    with pytest.raises(ValueError, match="multiple of block_size"):
        ParallelConfig(pcp=2, kv_interleave=24).interleave(16)


def test_stage_layers_cover_all_layers() -> None:
    assert [stage_layers(27, 2, s) for s in range(2)] == [range(0, 14), range(14, 27)]
    assert [stage_layers(3, 3, s) for s in range(3)] == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ValueError, match="exceeds"):
        stage_layers(3, 4, 0)


@pytest.mark.parametrize("n", [1, 7, 8, 64, 607])
@pytest.mark.parametrize("pcp", [1, 2, 4])
def test_zigzag_split_partitions_tokens(n, pcp) -> None:
    parts = [zigzag_indices(n, pcp, r) for r in range(pcp)]
    assert sorted(i for p in parts for i in p) == list(range(n))
    size = -(-n // (2 * pcp))
    for r, p in enumerate(parts):
        # rank r holds chunk r followed by chunk 2*pcp-1-r
        expected = list(range(r * size, min((r + 1) * size, n)))
        expected += list(range(min((2 * pcp - 1 - r) * size, n), min((2 * pcp - r) * size, n)))
        assert p == expected


def test_zigzag_balances_causal_work() -> None:
    n, pcp = 4096, 4
    work = [sum(i + 1 for i in zigzag_indices(n, pcp, r)) for r in range(pcp)]
    assert max(work) / min(work) < 1.01


def test_sharded_blocks_live_on_exactly_one_rank() -> None:
    n, bs, pcp = 607, 16, 4
    owned = [owned_logical_blocks(n, bs, pcp, bs, r) for r in range(pcp)]
    assert sorted(j for o in owned for j in o) == list(range(-(-n // bs)))
    assert owned[1][:3] == [1, 5, 9]
    # interleave of two blocks: blocks 0,1 on rank 0, 2,3 on rank 1, ...
    assert owned_logical_blocks(n, bs, 2, 32, 0)[:4] == [0, 1, 4, 5]
    assert kv_owner(33, 2, 32) == 1
