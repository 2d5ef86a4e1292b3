"""MLA attention on one rank of a PCP group (the step's layout comes from ``step_plan.PCPStep``).

Per layer:

1. The new latents (``kv_c_normed | k_pe``) of this rank's prefill rows are all-gathered over the PCP
   group, so every rank has every new token of the step in order.
2. The cache is written: sharded, each rank stores the positions it owns; replicated, all of them.
3. Prefill rows attend (decompressed form) the new tokens up to their own position
   (``pcp_local_attention``) and the request's cached context, merged by log-sum-exp. Sharded
   context is all-gathered from its holders first; replicated context is read locally.
4. Decode rows (on every rank) attend in the absorbed form. Sharded, each rank covers the positions
   it holds and the partial results are all-gathered and merged by log-sum-exp; a rank holding none
   of a request's positions contributes LSE = −inf.

Every collective's sizes follow from the plan, so all ranks of the group call the same sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.attention_ops import attention_lse, merge_attention
from engine.forward_batch import ForwardBatch, gather_latents
from engine.parallel.collectives import PendingGather, gather_padded, start_gather
from engine.parallel.pcp_attention import pcp_local_attention

if TYPE_CHECKING:
    from engine.mla import MLAttention


def start_new_kv_gather(latent: torch.Tensor, batch: ForwardBatch) -> PendingGather | None:
    """Step 1 started early: the all-gather of this rank's new prefill latents [T - decodes, L+R]."""
    st = batch.pcp
    assert st is not None
    return start_gather(latent[st.num_decode :], st.new_counts, st.group) if st.num_new else None


def pcp_attention(
    attn: MLAttention,
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
    new = None
    if st.num_new:
        assert pending is not None
        new = pending.wait()[st.new_index]
        flat_cache[st.new_write_slots] = new[st.new_write_src].to(flat_cache.dtype)
    if st.dec_write_rows.numel():
        flat_cache[st.dec_write_slots] = latent[st.dec_write_rows].to(flat_cache.dtype)

    ctx = None
    if st.num_ctx:
        mine = flat_cache[st.ctx_read_slots]
        ctx = mine if st.ctx_index is None else gather_padded(mine, st.ctx_counts, st.group)[st.ctx_index]
        ctx = ctx.to(latent.dtype)

    out = latent.new_empty(latent.shape[0], attn.num_heads, attn.cfg.v_head_dim)
    if nd:
        out[:nd] = _decode(attn, q_nope[:nd], q_pe[:nd], batch, flat_cache, block_size)
    for seg in st.segments:
        rows = seg.local_rows
        if rows.stop == rows.start:
            continue
        assert new is not None
        seg_new = new[seg.new]
        k, v = attn._expand_kv(seg_new[:, :L], seg_new[:, L:])
        q = torch.cat((q_nope[rows], q_pe[rows]), dim=-1)
        o, lse = pcp_local_attention(q, seg.runs, k, v, attn.scale)
        if seg.ctx.stop > seg.ctx.start:
            assert ctx is not None
            seg_ctx = ctx[seg.ctx]
            kc, vc = attn._expand_kv(seg_ctx[:, :L], seg_ctx[:, L:])
            oc, lc = attention_lse(q, kc, vc, attn.scale, causal=False)
            o, lse = merge_attention(oc, lc, o, lse)
        out[rows] = o
    return out


def _decode(
    attn: MLAttention,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    batch: ForwardBatch,
    flat_cache: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    st = batch.pcp
    assert st is not None
    pos = torch.arange(batch.decode_max_len, device=q_nope.device)
    kv = gather_latents(batch.decode_block_tables, pos, flat_cache, block_size)
    out_lat, lse = attn.absorbed_attention(q_nope, q_pe, kv, st.dec_mask)
    if st.sharded:
        b, h, lat = out_lat.shape
        both = torch.cat((out_lat, lse.unsqueeze(-1)), dim=-1).view(b, h * (lat + 1))
        parts = gather_padded(both, [b] * st.size, st.group).view(st.size, b, h, lat + 1)
        out_lat, lse = parts[0, ..., :lat], parts[0, ..., lat]
        for i in range(1, st.size):
            out_lat, lse = merge_attention(out_lat, lse, parts[i, ..., :lat], parts[i, ..., lat])
    return attn.expand_latent_out(out_lat, q_nope.dtype)
