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
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each run's rows attending causally to the run's own keys ``k[a:b]`` (k/v indexed by new-token
    position; only the runs' own positions are read, so the rest may be unfilled yet): the part that
    needs nothing from other ranks. -> per run (out [b - a, H, Dv], lse [b - a, H])."""
    parts = []
    row = 0
    for a, b in runs:
        parts.append(attention_lse(q[row : row + b - a], k[a:b], v[a:b], scale, causal=True))
        row += b - a
    return parts


def finish_runs(
    q: torch.Tensor,
    runs: list[tuple[int, int]],
    squares: list[tuple[torch.Tensor, torch.Tensor]],
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse_out: torch.Tensor | None = None,
    context: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Merge into each run ``[a, b)`` its fully visible keys ``[0, a)`` (k/v_prefix cover at least
    ``[0, max a)``) and, if given, its rows' part of an attention over other keys (``context``: out
    and lse for all of q's rows), writing the result into ``out`` (and ``lse_out``) [S_local, ...].

    The last merge of each run writes straight into ``out``, so no per-run result is copied again.
    A run with a = 0 has no prefix (LSE = −inf): its causal square is its result.
    """
    row = 0
    for (a, b), (o, lse) in zip(runs, squares):
        sl = slice(row, row + b - a)
        row += b - a
        dst = (out[sl], None if lse_out is None else lse_out[sl])
        if a:
            pre = attention_lse(q[sl], k_prefix[:a], v_prefix[:a], scale, causal=False)
            o, lse = merge_attention(*pre, o, lse, out=None if context is not None else dst)
        if context is not None:
            merge_attention(context[0][sl], context[1][sl], o, lse, out=dst)
        elif not a:
            dst[0].copy_(o)
            if dst[1] is not None:
                dst[1].copy_(lse)


def pcp_local_attention(
    q: torch.Tensor, runs: list[tuple[int, int]], k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [S_local, H, Dq] for the new-token index ``runs`` (ascending, half-open, see
    ``contiguous_runs``); k/v [N, H, ·] all new tokens -> causal attention within the new tokens,
    (out [S_local, H, Dv], lse [S_local, H])."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    lse = q.new_empty(q.shape[0], q.shape[1], dtype=torch.promote_types(q.dtype, torch.float32))
    finish_runs(q, runs, causal_squares(q, runs, k, v, scale), k, v, scale, out, lse)
    return out, lse
