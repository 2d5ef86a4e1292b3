"""Attention of one PCP rank's query rows against the step's all-gathered new keys.

Under PCP a rank holds only its zigzag rows of a request's new tokens, but after the all-gather of
the new latent KV it has every new key. Each local row must see the keys up to its own global
position. The zigzag rows form at most two contiguous runs ``[a, b)``; for each run the keys split
into a fully visible prefix ``[0, a)`` and a causal square ``[a, b)``, two standard attention calls
merged by log-sum-exp (so the fused kernels apply; no arbitrary masks). An empty prefix contributes
LSE = −inf.
"""

from __future__ import annotations

import torch

from engine.attention_ops import attention_lse, merge_attention


def contiguous_runs(indices: list[int]) -> list[tuple[int, int]]:
    """[0, 1, 2, 9, 10] -> [(0, 3), (9, 11)]: half-open runs of consecutive indices."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def causal_squares(
    q: torch.Tensor, runs: list[tuple[int, int]], k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each run's rows attending causally to the run's own keys ``k[a:b]`` (k/v indexed by new-token
    position; only the runs' own positions are read, so the rest may be unfilled yet): the part that
    needs nothing from other ranks. -> (out [S_local, H, Dv], lse [S_local, H])."""
    if not runs:
        lse_dtype = torch.promote_types(q.dtype, torch.float32)
        return q.new_empty(0, q.shape[1], v.shape[-1]), q.new_empty(0, q.shape[1], dtype=lse_dtype)
    outs, lses = [], []
    row = 0
    for a, b in runs:
        out, lse = attention_lse(q[row : row + b - a], k[a:b], v[a:b], scale, causal=True)
        outs.append(out)
        lses.append(lse)
        row += b - a
    return torch.cat(outs), torch.cat(lses)


def add_prefixes(
    q: torch.Tensor,
    runs: list[tuple[int, int]],
    out: torch.Tensor,
    lse: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge into each run ``[a, b)`` its fully visible keys ``[0, a)`` (k/v_prefix cover at least
    ``[0, max a)``). A run with a = 0 has none (its LSE part is −inf, so it is left as it is)."""
    row = 0
    for a, b in runs:
        sl = slice(row, row + b - a)
        row += b - a
        if a == 0:
            continue
        o_p, l_p = attention_lse(q[sl], k_prefix[:a], v_prefix[:a], scale, causal=False)
        out[sl], lse[sl] = merge_attention(o_p, l_p, out[sl], lse[sl])
    return out, lse


def pcp_local_attention(
    q: torch.Tensor, runs: list[tuple[int, int]], k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [S_local, H, Dq] for the new-token index ``runs`` (ascending, half-open, see
    ``contiguous_runs``); k/v [N, H, ·] all new tokens -> causal attention within the new tokens.
    """
    out, lse = causal_squares(q, runs, k, v, scale)
    return add_prefixes(q, runs, out, lse, k, v, scale)
