"""MLA attention on one rank of a PCP group (the step's layout comes from ``pcp_step.PCPStep``).

Per layer:

1. The all-gather of this rank's new prefill latents (``kv_c_normed | k_pe``) over the PCP group
   starts as soon as they exist, before the q projection (``start_new_kv_gather``).
2. While it is in flight, each zigzag run's rows attend causally to the run's own keys (local).
   Decode rows (on every rank) store their new token where it is held and attend in the absorbed
   form; sharded, each rank covers the positions it holds and the partial results are
   all-gathered and merged by log-sum-exp (a rank holding none contributes LSE = −inf).
3. With every new token of the step in order, the cache is written (sharded: the positions this
   rank owns; replicated: all), and each run merges in its fully visible prefix of new keys and the
   request's cached context (sharded: all-gathered from its holders; replicated: read locally),
   both by log-sum-exp.

Every collective's sizes follow from the plan, so all ranks of the group call the same sequence.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.attention_ops import attention_lse, merge_attention
from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch, gather_latents
from engine.kv_format import KVFormat
from engine.parallel.collectives import PendingGather, gather_padded, start_gather
from engine.parallel.pcp_attention import causal_squares, finish_runs


class LatentAttention(Protocol):
    """What this path uses of the attention layer it computes for: ``engine.mla.MLAttention``, which calls
    ``pcp_attention`` with itself (declared here, so that the layer's module imports this one and not
    the other way round)."""

    cfg: ModelConfig
    num_heads: int
    scale: float
    kv_format: KVFormat  # how the cache stores latents

    def expand_kv(
        self, kv_c: torch.Tensor, k_pe: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent [K, L] + rope key [K, R] -> per-head k [K, H, nope+rope], v [K, H, v] (into ``out``)."""
        ...

    def absorbed_attention(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, want_lse: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """MQA over latents kv [B, T, L+R] where ``mask`` [B, T] -> (latent out [B, H, L] fp32, lse [B, H])."""
        ...

    def expand_latent_out(self, out_lat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Latent attention output [B, H, L] -> per-head values [B, H, v]."""
        ...


def start_new_kv_gather(latent: torch.Tensor, batch: ForwardBatch) -> PendingGather | None:
    """Step 1 started early: the all-gather of this rank's new prefill latents [T - decodes, L+R]."""
    st = batch.pcp
    assert st is not None
    return start_gather(latent[st.num_decode :], st.new_counts, st.group) if st.num_new else None


def pcp_attention(
    attn: LatentAttention,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    pending: PendingGather | None,
    batch: ForwardBatch,
    flat_cache: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Local rows' q [T, H, ·], new latents [T, L+R] and their gather in flight -> output [T, H, v]."""
    st = batch.pcp
    assert st is not None
    L = attn.cfg.kv_lora_rank
    nd = st.num_decode
    out = latent.new_empty(latent.shape[0], attn.num_heads, attn.cfg.v_head_dim)
    # While the all-gather is in flight: each zigzag run's causal square needs only this rank's keys.
    # Per segment, K/V live in one buffer in token order: local runs expanded now, the rest of the
    # visible prefix after the gather, so no token is expanded twice.
    parts = []
    for seg in st.segments:
        rows = seg.local_rows
        q = torch.cat((q_nope[rows], q_pe[rows]), dim=-1)
        n = seg.new.stop - seg.new.start
        k_all = latent.new_empty(n, attn.num_heads, attn.cfg.qk_head_dim)
        v_all = latent.new_empty(n, attn.num_heads, attn.cfg.v_head_dim)
        row = rows.start
        for a, b in seg.runs:
            own = latent[row : row + b - a]
            attn.expand_kv(own[:, :L], own[:, L:], out=(k_all[a:b], v_all[a:b]))
            row += b - a
        parts.append((q, k_all, v_all, causal_squares(q, seg.runs, k_all, v_all, attn.scale)))
    if nd:
        out[:nd] = _decode(attn, q_nope[:nd], q_pe[:nd], batch, flat_cache, block_size, latent[:nd])

    new = None
    if st.num_new:
        assert pending is not None
        new = pending.wait()[st.new_index]
        attn.kv_format.store(flat_cache, st.new_write_slots, new[st.new_write_src])
    ctx = None
    if st.num_ctx:
        # The stored rows travel (fewer bytes when the cache is FP8); each rank decodes what it gathered.
        mine = flat_cache[st.ctx_read_slots]
        if st.ctx_index is None:
            ctx = mine
        else:  # as bytes: the collectives need not know float8
            ctx = gather_padded(mine.view(torch.uint8), st.ctx_counts, st.group)[st.ctx_index].view(mine.dtype)
        ctx = attn.kv_format.decode(ctx).to(latent.dtype)

    for seg, (q, k_all, v_all, squares) in zip(st.segments, parts):
        rows = seg.local_rows
        if rows.stop == rows.start:
            continue
        assert new is not None
        reach = max(a for a, _ in seg.runs)  # keys [0, reach) are some run's fully visible prefix
        for c, d in _gaps(seg.runs, reach):  # the prefix tokens other ranks computed
            seg_new = new[seg.new.start + c : seg.new.start + d]
            attn.expand_kv(seg_new[:, :L], seg_new[:, L:], out=(k_all[c:d], v_all[c:d]))
        context = None
        if seg.ctx.stop > seg.ctx.start:
            assert ctx is not None
            seg_ctx = ctx[seg.ctx]
            kc, vc = attn.expand_kv(seg_ctx[:, :L], seg_ctx[:, L:])
            context = attention_lse(q, kc, vc, attn.scale, causal=False)
        finish_runs(q, seg.runs, squares, k_all, v_all, attn.scale, out[rows], context=context)
    return out


def _gaps(runs: list[tuple[int, int]], end: int) -> list[tuple[int, int]]:
    """The parts of [0, end) not covered by the (ascending, disjoint) runs."""
    out, pos = [], 0
    for a, b in runs:
        if a >= end:
            break
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
    if pos < end:
        out.append((pos, end))
    return out


def _decode(
    attn: LatentAttention,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    batch: ForwardBatch,
    flat_cache: torch.Tensor,
    block_size: int,
    latent: torch.Tensor,
) -> torch.Tensor:
    """Decode rows (the same on every PCP rank): store the new token where held, attend, merge."""
    st = batch.pcp
    assert st is not None
    if st.dec_write_rows.numel():
        attn.kv_format.store(flat_cache, st.dec_write_slots, latent[st.dec_write_rows])
    pos = torch.arange(batch.decode_max_len, device=q_nope.device)
    kv = gather_latents(batch.decode_block_tables, pos, flat_cache, block_size, attn.kv_format)
    out_lat, lse = attn.absorbed_attention(q_nope, q_pe, kv, st.dec_mask)
    if st.sharded:
        assert lse is not None  # asked for (want_lse defaults to True)
        b, h, lat = out_lat.shape
        both = torch.cat((out_lat, lse.unsqueeze(-1)), dim=-1).view(b, h * (lat + 1))
        parts = gather_padded(both, [b] * st.size, st.group).view(st.size, b, h, lat + 1)
        out_lat, lse = parts[0, ..., :lat], parts[0, ..., lat]
        for i in range(1, st.size):
            out_lat, lse = merge_attention(out_lat, lse, parts[i, ..., :lat], parts[i, ..., lat])
    return attn.expand_latent_out(out_lat, q_nope.dtype)
