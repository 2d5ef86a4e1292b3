"""Multi-head latent attention (MLA) over a paged latent cache.

Per token the cache keeps ``[kv_c (kv_lora_rank) | k_pe (qk_rope_head_dim)]`` — vLLM's MLA layout,
``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` per layer.

- Prefill (decompressed / MHA form): ``kv_b_proj`` expands the latent into per-head ``k_nope`` and
  ``v``; new tokens attend causally to themselves, and cached context (chunked prefill) is attended
  separately and merged by log-sum-exp.
- Decode (absorbed / MQA form): ``q_nope`` is folded through W_UK into latent space and attends the
  cached latents directly; the latent output is expanded through W_UV. No per-head K/V are built.
  On CUDA the attention is one fused Triton kernel on the paged cache (``engine.mla_decode``; set
  ``DECODE_KERNEL = "torch"`` for the gather + einsum path, which CPU always takes).
"""

from __future__ import annotations

import torch
from torch import nn

from engine import norm_kernels
from engine.attention_ops import attention, attention_lse, merge_attention
from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch, gather_latents, slots_for
from engine.kv_format import KVFormat
from engine.layers import RMSNorm
from engine.mla_decode import HAS_TRITON, mla_decode
from engine.parallel.pcp_mla import pcp_attention, start_new_kv_gather
from engine.rope import RotaryEmbedding

DECODE_KERNEL = "triton"  # CUDA decode attention: "triton" (fused, engine.mla_decode) or "torch"
# New rows over a cached context (chunked prefill, prefix-cache hits): "joint" decompresses the context
# and the new rows together and runs one causal attention (bottom-right aligned); "split" attends the
# new rows and the context apart and merges them by log-sum-exp (three more kernels and a merge per
# layer: benchmarks/prefill_host.py compares them).
CONTEXT_ATTENTION = "joint"


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, kv_format: KVFormat | None = None) -> None:
        """``kv_format``: how the cache stores latents (default: ``auto`` in the default dtype, the model's
        while it is built)."""
        super().__init__()
        self.cfg = cfg
        self.kv_format = kv_format or KVFormat("auto", cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                                               torch.get_default_dtype())
        h = cfg.num_attention_heads
        self.num_heads = h
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_cache_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, cfg.hidden_size, bias=False)
        self.scale = cfg.softmax_scale
        # "decompressed" routes decode rows through the prefill (MHA) path: a check of the absorbed math.
        self.decode_form = "absorbed"

    # -- projections ---------------------------------------------------------------------------
    def _project_q(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(-1, self.num_heads, self.cfg.qk_head_dim)  # [T, H, nope+rope]

    def expand_kv(
        self, kv_c: torch.Tensor, k_pe: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent [K, L] + rope key [K, R] -> per-head k [K, H, nope+rope], v [K, H, v].

        With ``out`` (contiguous views, e.g. slices of a token-ordered buffer) the results are
        written there instead of into new tensors.
        """
        cfg = self.cfg
        kv = self.kv_b_proj(kv_c).view(-1, self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k_pe_heads = k_pe.unsqueeze(1).expand(-1, self.num_heads, -1)
        if out is None:
            return torch.cat((k_nope, k_pe_heads), dim=-1), v
        k_out, v_out = out
        torch.cat((k_nope, k_pe_heads), dim=-1, out=k_out)
        v_out.copy_(v)
        return k_out, v_out

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, L] and W_UV [H, v, L], views of kv_b_proj."""
        cfg = self.cfg
        w = self.kv_b_proj.weight.view(self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]

    # -- forward -------------------------------------------------------------------------------
    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, cache: torch.Tensor, rope: RotaryEmbedding
    ) -> torch.Tensor:
        """x: [T, D]; cache: this layer's [num_blocks, block_size, row width] of ``kv_format``'s rows (written in
        place) -> [T, D]."""
        cfg = self.cfg
        kv_a = self.kv_a_proj_with_mqa(x)
        flat_cache = cache.view(-1, cache.shape[-1])
        fmt = self.kv_format
        if batch.pcp is None and norm_kernels.supported(x):
            # one kernel: kv_c's norm, k_pe's and q_pe's rope (q in place), the latents and their cache write
            q = self._project_q(x)
            latent = norm_kernels.mla_latent(
                kv_a, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, cfg.kv_lora_rank, batch.positions,
                rope.cos, rope.sin, rope.interleave, q, cfg.qk_nope_head_dim, flat_cache, batch.slot_mapping,
                kv_format=fmt)
            kv_c, k_pe = latent.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
            return self._attend(x, q, kv_c, k_pe, batch, flat_cache, cache.shape[1])
        kv_c = self.kv_a_layernorm(kv_a[:, : cfg.kv_lora_rank])
        k_pe = rope.apply(kv_a[:, cfg.kv_lora_rank :], batch.positions)
        latent = torch.cat((kv_c, k_pe), dim=-1)
        # Under PCP the new latents' all-gather starts now and overlaps the q projection.
        pending = start_new_kv_gather(latent, batch) if batch.pcp is not None else None
        q = self._project_q(x)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        q_pe = rope.apply(q_pe, batch.positions)
        if batch.pcp is not None:
            out = pcp_attention(self, q_nope, q_pe, latent, pending, batch, flat_cache, cache.shape[1])
            return self.o_proj(out.flatten(1))
        fmt.store(flat_cache, batch.slot_mapping, latent)
        return self._attend(x, torch.cat((q_nope, q_pe), dim=-1), kv_c, k_pe, batch, flat_cache, cache.shape[1])

    def _attend(self, x: torch.Tensor, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                batch: ForwardBatch, flat_cache: torch.Tensor, block_size: int) -> torch.Tensor:
        """Attention of this step's rows (q [T, H, nope+rope] rotated; their latents already in the
        cache) -> o_proj output [T, D]."""
        cfg = self.cfg
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        out = x.new_empty(x.shape[0], self.num_heads, cfg.v_head_dim)
        nd = batch.num_decode
        if nd and self.decode_form == "absorbed":
            out[:nd] = self._decode_absorbed(q_nope[:nd], q_pe[:nd], batch, flat_cache, block_size)
        elif nd:
            for row in range(nd):
                seq_len = int(batch.decode_seq_lens[row])  # debug path: a sync per row is fine
                table = batch.decode_block_tables[row]
                out[row : row + 1] = self._prefill_one(
                    q[row : row + 1], kv_c[row : row + 1], k_pe[row : row + 1], seq_len - 1, table, flat_cache,
                    block_size,
                )
        for seg in batch.prefills:
            rows = slice(seg.start, seg.start + seg.num_new)
            out[rows] = self._prefill_one(
                q[rows], kv_c[rows], k_pe[rows], seg.context_len, seg.block_table, flat_cache, block_size,
            )
        return self.o_proj(out.flatten(1))

    def _prefill_one(
        self,
        q: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        context_len: int,
        block_table: torch.Tensor,
        flat_cache: torch.Tensor,
        block_size: int,
    ) -> torch.Tensor:
        """One request's new rows [S, ...] (q: [S, H, nope+rope]) attending its cached context and
        itself -> [S, H, v]."""
        if context_len == 0:
            return attention(q, *self.expand_kv(kv_c, k_pe), self.scale, causal=True)
        ctx = self.kv_format.load(flat_cache, slots_for(block_table, 0, context_len, block_size)).to(kv_c.dtype)
        lora = self.cfg.kv_lora_rank
        if CONTEXT_ATTENTION == "joint":  # the new rows are the last of the keys
            kv_all = torch.cat((ctx, torch.cat((kv_c, k_pe), dim=-1)))
            return attention(q, *self.expand_kv(kv_all[:, :lora], kv_all[:, lora:]), self.scale, causal=True)
        k, v = self.expand_kv(kv_c, k_pe)
        out_new, lse_new = attention_lse(q, k, v, self.scale, causal=True)
        k_ctx, v_ctx = self.expand_kv(ctx[:, :lora], ctx[:, lora:])
        out_ctx, lse_ctx = attention_lse(q, k_ctx, v_ctx, self.scale, causal=False)
        return merge_attention(out_ctx, lse_ctx, out_new, lse_new)[0]

    def _decode_absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: ForwardBatch, flat_cache: torch.Tensor, bs: int
    ) -> torch.Tensor:
        """q_nope [B, H, nope], q_pe [B, H, R] -> [B, H, v] over each request's cached latents."""
        tables, lens = batch.decode_block_tables, batch.decode_seq_lens
        if flat_cache.is_cuda and HAS_TRITON and DECODE_KERNEL == "triton":
            w_uk, _ = self._absorbed_weights()
            q_lat = torch.einsum("bhn,hnl->bhl", q_nope, w_uk)  # [B, H, L]
            cache = flat_cache.view(-1, bs, flat_cache.shape[-1])  # [num_blocks, block_size, L+R]
            out_lat, _ = mla_decode(q_lat, q_pe, cache, tables, lens, self.scale, grouped=batch.decode_grouped,
                                    kv_format=self.kv_format, memo=batch.decode_memo)
            return self.expand_latent_out(out_lat, q_nope.dtype)
        pos = torch.arange(batch.decode_max_len, device=tables.device)
        mask = pos[None, :] < lens[:, None]
        out_lat, _ = self.absorbed_attention(
            q_nope, q_pe, gather_latents(tables, pos, flat_cache, bs, self.kv_format), mask, want_lse=False
        )
        return self.expand_latent_out(out_lat, q_nope.dtype)

    def absorbed_attention(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, want_lse: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """MQA over latents kv [B, T, L+R] where ``mask`` [B, T] -> (latent out [B, H, L] fp32, lse [B, H]).

        With ``want_lse``, rows whose mask is all False get lse = -inf and a zero output (never NaN);
        without it (every row has a key) a plain softmax: fewer kernels on the decode hot path.
        """
        w_uk, _ = self._absorbed_weights()
        q_lat = torch.einsum("bhn,hnl->bhl", q_nope, w_uk)  # [B, H, L]
        qq = torch.cat((q_lat, q_pe), dim=-1)  # [B, H, L+R]
        scores = torch.einsum("bhc,btc->bht", qq.float(), kv.float()) * self.scale
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
        lat = kv[..., : self.cfg.kv_lora_rank].float()
        if not want_lse:
            return torch.einsum("bht,btl->bhl", scores.softmax(dim=-1), lat), None
        lse = torch.logsumexp(scores, dim=-1)
        p = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(scores.dtype).min))
        return torch.einsum("bht,btl->bhl", p, lat), lse

    def expand_latent_out(self, out_lat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Latent attention output [B, H, L] -> per-head values [B, H, v] through W_UV."""
        _, w_uv = self._absorbed_weights()
        return torch.einsum("bhl,hvl->bhv", out_lat.to(dtype), w_uv)

