"""Attention kernels for the decompressed (MHA) prefill form, with log-sum-exp for merging parts.

Layout: q [S, H, Dq], k [K, H, Dq], v [K, H, Dv]; outputs [S, H, Dv] and lse [S, H] (fp32, natural
log). ``causal`` aligns the last query with the last key (queries are the last S of the K keys).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_QUERY_CHUNK = 1024  # bounds the [H, S, K] score matrix of the reference path


def _use_flash(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _pad_v(v: torch.Tensor, dq: int) -> torch.Tensor:
    return v if v.shape[-1] == dq else F.pad(v, (0, dq - v.shape[-1]))


# Fused attention on CUDA: "cudnn" (Hopper-tuned; takes v with its own head size, 128, next to
# q/k of 192) or "flash" (PyTorch's FlashAttention-2, which needs v padded to q's head size), or
# "auto": cuDNN from CUDNN_MIN_ROWS query rows, FlashAttention below. cuDNN runs 2-3x faster on a
# shape it has seen (benchmarks/attention_kernels.py), but builds an execution plan for every new
# shape first: 37-48 ms on an H200, once per step for all layers, and serving brings a new prompt
# length with nearly every request. Measured per new shape over V2-Lite's 27 layers, causal: 8k
# rows, flash 43 ms against cuDNN 20 + 39 ms; 16k rows, flash 151 ms against cuDNN 62 + 41 ms
# (docs/benchmarks.md, "Prefix caching and the attention kernel").
LSE_KERNEL = "auto"
CUDNN_MIN_ROWS = 12288
# With CUDNN_BUCKET > 0, a prompt's causal attention over itself alone (no cached context, no LSE)
# runs on cuDNN from CUDNN_BUCKET_MIN_ROWS rows, its rows padded to a multiple of CUDNN_BUCKET: a plan
# per bucket instead of per length, so serving builds a few and then reuses them. Padding keys come
# after every real query, so the causal mask hides them; padding queries' rows are dropped. Nodes plan
# every bucket at start-up (warm_cudnn_buckets: 21 buckets in 1.4 s on an H200). Off: on prompts of
# 1k-12k tokens one engine alone took 0.84x the default's mean prefill time (benchmarks/prefill_lengths.py
# --warm), but the whole cluster's TTFT did not improve (1.02-1.16x the default's; docs/benchmarks.md).
CUDNN_BUCKET = 0
CUDNN_BUCKET_MIN_ROWS = 2048


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """[S, H, D] -> the [1, H, S, D] layout the fused kernels take."""
    return x.transpose(0, 1).unsqueeze(0)


def _fused(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, lse: bool, flash: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``flash``: FlashAttention whatever ``LSE_KERNEL`` says (its causal mask is aligned bottom-right when
    there are fewer queries than keys)."""
    dv = v.shape[-1]
    if not flash and (LSE_KERNEL == "cudnn" or (LSE_KERNEL == "auto" and q.shape[0] >= CUDNN_MIN_ROWS)):
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _bhsd(q), _bhsd(k), _bhsd(v.contiguous()), None, lse, 0.0, causal, False, scale=scale
        )
    else:
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            _bhsd(q), _bhsd(k), _bhsd(_pad_v(v, q.shape[-1])), 0.0, causal, False, scale=scale
        )
    out = res[0][0].transpose(0, 1)[..., :dv]
    if not lse:
        return out, None
    stats = res[1]  # [1, H, S] (cuDNN: [1, H, S, 1]), natural log
    return out, stats.reshape(stats.shape[1], -1).transpose(0, 1).float()


def _padded_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    out = x.new_empty((rows, *x.shape[1:]))
    out[: x.shape[0]] = x
    out[x.shape[0] :].zero_()  # finite scores for the padding rows
    return out


def _cudnn_bucketed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal self-attention of n rows on cuDNN, padded to the next multiple of CUDNN_BUCKET rows."""
    n = q.shape[0]
    rows = -(-n // CUDNN_BUCKET) * CUDNN_BUCKET
    if rows != n:
        q, k, v = (_padded_rows(x, rows) for x in (q, k, v))
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _bhsd(q), _bhsd(k), _bhsd(v.contiguous()), None, False, 0.0, True, False, scale=scale
    )
    return res[0][0].transpose(0, 1)[:n]


def warm_cudnn_buckets(num_heads: int, qk_dim: int, v_dim: int, max_rows: int, dtype: torch.dtype,
                       device: torch.device) -> int:
    """With ``CUDNN_BUCKET`` set, run each bucket's shape once up to ``max_rows`` (a prefill step's most
    rows), so cuDNN's plans are built at start-up instead of by the first requests of each bucket.
    Returns the buckets planned (0 when bucketing is off or not on CUDA)."""
    if not CUDNN_BUCKET or device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return 0
    first = -(-CUDNN_BUCKET_MIN_ROWS // CUDNN_BUCKET) * CUDNN_BUCKET
    last = -(-max_rows // CUDNN_BUCKET) * CUDNN_BUCKET
    if last < first:
        return 0
    q = torch.zeros(last, num_heads, qk_dim, dtype=dtype, device=device)
    v = torch.zeros(last, num_heads, v_dim, dtype=dtype, device=device)
    buckets = range(first, last + 1, CUDNN_BUCKET)
    for rows in buckets:  # contiguous row prefixes: the layouts _cudnn_bucketed passes
        _cudnn_bucketed(q[:rows], q[:rows], v[:rows], 1.0)
    torch.cuda.synchronize(device)
    return len(buckets)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """Plain attention without the lse (a prefill, with or without cached context before its rows)."""
    if (CUDNN_BUCKET and causal and _use_flash(q) and q.shape[0] == k.shape[0] >= CUDNN_BUCKET_MIN_ROWS
            and LSE_KERNEL != "flash"):
        return _cudnn_bucketed(q, k, v, scale)
    if q.shape[0] != k.shape[0] and causal:
        if _use_flash(q):  # the new rows are the last of the keys: FlashAttention's bottom-right mask
            return _fused(q, k, v, scale, causal, lse=False, flash=True)[0]
        return attention_lse(q, k, v, scale, causal)[0]
    if _use_flash(q):
        return _fused(q, k, v, scale, causal, lse=False)[0]
    out = F.scaled_dot_product_attention(_bhsd(q), _bhsd(k), _bhsd(v), is_causal=causal, scale=scale)
    return out[0].transpose(0, 1)


def attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention returning (out [S, H, Dv], lse [S, H])."""
    if _use_flash(q) and (not causal or q.shape[0] == k.shape[0]):
        out, lse = _fused(q, k, v, scale, causal, lse=True)
        assert lse is not None
        return out, lse
    return _attention_lse_reference(q, k, v, scale, causal)


def _attention_lse_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    s, kn = q.shape[0], k.shape[0]
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 math, or fp64 for fp64 inputs
    kf, vf = k.to(acc), v.to(acc)
    outs, lses = [], []
    for q0 in range(0, s, _QUERY_CHUNK):
        qc = q[q0 : q0 + _QUERY_CHUNK].to(acc)
        scores = torch.einsum("shd,khd->hsk", qc, kf) * scale  # [H, s, K]
        if causal:
            qpos = torch.arange(q0, q0 + qc.shape[0], device=q.device) + (kn - s)
            mask = torch.arange(kn, device=q.device)[None, :] > qpos[:, None]
            scores = scores.masked_fill(mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [H, s]
        p = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(acc).min))
        outs.append(torch.einsum("hsk,khd->shd", p, vf))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs).to(q.dtype), torch.cat(lses)


def merge_attention(
    o1: torch.Tensor,
    lse1: torch.Tensor,
    o2: torch.Tensor,
    lse2: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attention results over disjoint key sets. An empty part has lse = -inf (never NaN).

    The weights are computed in fp32 on [S, H]; the outputs are mixed in their own dtype by one
    ``lerp`` (in bf16 that reads and writes each output once instead of round-tripping it through
    fp32, about a tenth of the memory traffic; the weight is rounded to bf16, within the rounding
    the output gets anyway). With ``out`` (output, and lse or None) the results are written there.
    """
    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # both parts empty: keep weights finite (0)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)  # [S, H]
    denom = w1 + w2
    safe = torch.where(denom == 0, torch.ones_like(denom), denom)
    w = (w1 / safe).unsqueeze(-1).to(o1.dtype)
    o = torch.lerp(o2, o1, w) if out is None else torch.lerp(o2, o1, w, out=out[0])
    lse = torch.where(denom == 0, torch.full_like(m, float("-inf")), m + torch.log(safe))
    if out is not None and out[1] is not None:
        out[1].copy_(lse)
    return o, lse
