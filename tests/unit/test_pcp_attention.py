"""PCP attention simulated in one process: the ranks' zigzag rows, reassembled, equal full causal attention."""

from __future__ import annotations

import pytest
import torch

from engine.attention_ops import attention_lse, merge_attention
from engine.parallel.pcp_attention import contiguous_runs, pcp_local_attention
from engine.parallel.pcp_split import zigzag_indices


def test_contiguous_runs() -> None:
    assert contiguous_runs([0, 1, 2, 9, 10]) == [(0, 3), (9, 11)]
    assert contiguous_runs([]) == []
    assert contiguous_runs([4]) == [(4, 5)]


@pytest.mark.parametrize("n", [1, 7, 64, 607])
@pytest.mark.parametrize("pcp", [2, 4])
def test_zigzag_ranks_reassemble_full_causal_attention(n, pcp) -> None:
    g = torch.Generator().manual_seed(n * 10 + pcp)
    h, dq, dv = 3, 24, 16
    q = torch.randn(n, h, dq, generator=g, dtype=torch.float64)
    k = torch.randn(n, h, dq, generator=g, dtype=torch.float64)
    v = torch.randn(n, h, dv, generator=g, dtype=torch.float64)
    ref, ref_lse = attention_lse(q, k, v, 0.2, causal=True)
    out = torch.full_like(ref, float("nan"))
    lse = torch.full_like(ref_lse, float("nan"))
    for r in range(pcp):
        idx = zigzag_indices(n, pcp, r)
        o, s = pcp_local_attention(q[idx], contiguous_runs(idx), k, v, 0.2)
        out[idx], lse[idx] = o, s
    assert not out.isnan().any()
    assert torch.allclose(out, ref, atol=1e-10) and torch.allclose(lse, ref_lse, atol=1e-10)


def test_merge_with_an_empty_part_is_never_nan() -> None:
    o = torch.randn(4, 2, 8)
    lse = torch.randn(4, 2)
    empty_o, empty_lse = torch.zeros(4, 2, 8), torch.full((4, 2), float("-inf"))
    out, out_lse = merge_attention(empty_o, empty_lse, o, lse)
    assert torch.allclose(out, o) and torch.allclose(out_lse, lse)
    both, both_lse = merge_attention(empty_o, empty_lse, empty_o, empty_lse)
    assert not both.isnan().any() and torch.isinf(both_lse).all()
