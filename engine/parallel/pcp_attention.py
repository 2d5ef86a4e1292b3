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


def pcp_local_attention(
    q: torch.Tensor, runs: list[tuple[int, int]], k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [S_local, H, Dq] for the new-token index ``runs`` (ascending, half-open, see
    ``contiguous_runs``); k/v [N, H, ·] all new tokens.

    Returns (out [S_local, H, Dv], lse [S_local, H]) of causal attention within the new tokens.
    """
    outs, lses = [], []
    row = 0
    for a, b in runs:
        qr = q[row : row + (b - a)]
        row += b - a
        out, lse = attention_lse(qr, k[a:b], v[a:b], scale, causal=True)
        if a > 0:
            out_p, lse_p = attention_lse(qr, k[:a], v[:a], scale, causal=False)
            out, lse = merge_attention(out_p, lse_p, out, lse)
        outs.append(out)
        lses.append(lse)
    if not outs:
        lse_dtype = torch.promote_types(q.dtype, torch.float32)
        return q.new_empty(0, q.shape[1], v.shape[-1]), q.new_empty(0, q.shape[1], dtype=lse_dtype)
    return torch.cat(outs), torch.cat(lses)
