"""Fused Triton kernels for a decoder layer's small steps on CUDA: RMSNorm (with the residual add),
and MLA's latent step (kv_c's RMSNorm, rope of k_pe and q_pe, the latent row and its cache write).

Written in torch these steps are 7 to 30 small kernels each, and a decode step's time on the GPU is
mostly their launch gaps. Each kernel here is one launch, one program per token, and rounds where the
torch code rounds (the normalised row to the model dtype before the weight; rope in fp32, rounded once),
so results equal the torch path up to the order of the sum of squares. Triton is optional: without it
``HAS_TRITON`` is False and callers keep their torch code.
"""

# ruff: noqa: ANN001  (Triton kernel arguments are pointers and ints, typed by the JIT, not annotations)
from __future__ import annotations

import torch

from engine.kv_format import KERNEL_CODE, KVFormat

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

if HAS_TRITON:

    @triton.jit
    def _rms_norm(X, RES, W, OUT, RES_OUT, s_x, s_res, s_out, s_res_out, D, eps,
                  BD: tl.constexpr, HAS_RES: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BD)
        m = cols < D
        x = tl.load(X + t * s_x + cols, mask=m, other=0.0)
        if HAS_RES:  # x + residual, rounded to the model dtype as torch's add is; it is the new residual
            x = (x.to(tl.float32) + tl.load(RES + t * s_res + cols, mask=m, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(RES_OUT + t * s_res_out + cols, x, mask=m)
        xf = x.to(tl.float32)
        normed = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)).to(x.dtype)
        w = tl.load(W + cols, mask=m, other=0.0)
        tl.store(OUT + t * s_out + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(OUT.dtype.element_ty), mask=m)

    @triton.jit
    def _pair_ptrs(ptr, j, half: tl.constexpr, INTERLEAVE: tl.constexpr):
        """Pointers to the two halves of rope pair j: (x[2j], x[2j+1]) interleaved, else (x[j], x[half+j])."""
        if INTERLEAVE:
            return ptr + 2 * j, ptr + 2 * j + 1
        return ptr + j, ptr + half + j

    @triton.jit
    def _mla_latent(KVA, W, POS, COS, SIN, Q, LAT, CACHE, SLOTS, s_kva, s_q_t, s_q_h, s_lat, s_cache, H, eps,
                    kv_scale, L: tl.constexpr, BL: tl.constexpr, R: tl.constexpr, BR2: tl.constexpr,
                    NOPE: tl.constexpr, INTERLEAVE: tl.constexpr, WRITE_CACHE: tl.constexpr, FMT: tl.constexpr):
        # FMT: the cache row's format (engine.kv_format), as engine.mla_decode reads it: 0 the latent's dtype;
        # 1 e4m3 of x / kv_scale; 2 DeepSeek's bytes (e4m3 kv_c per 128 scaled by amax / 448, float32
        # scales, bf16 k_pe). The same arithmetic as KVFormat.encode, on the same bf16-rounded latent.
        t = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BL)
        m = cols < L
        kv = tl.load(KVA + t * s_kva + cols, mask=m, other=0.0)
        kvf = kv.to(tl.float32)
        normed = (kvf * tl.rsqrt(tl.sum(kvf * kvf, 0) / L + eps)).to(kv.dtype)
        kv_c = (tl.load(W + cols, mask=m, other=0.0).to(tl.float32) * normed.to(tl.float32)).to(LAT.dtype.element_ty)
        tl.store(LAT + t * s_lat + cols, kv_c, mask=m)
        if WRITE_CACHE:
            slot = tl.load(SLOTS + t).to(tl.int64)
            row = CACHE + slot * s_cache
            if FMT == 2:
                g = tl.reshape(kv_c.to(tl.float32), (BL // 128, 128))
                sc = tl.maximum(tl.max(tl.abs(g), 1), 1e-12) / 448.0  # [BL / 128]
                qg = tl.clamp(g / sc[:, None], -448.0, 448.0).to(tl.float8e4nv)
                tl.store(row + cols, tl.reshape(qg, (BL,)).to(tl.uint8, bitcast=True), mask=m)
                gi = tl.arange(0, BL // 128)
                tl.store((row + L).to(tl.pointer_type(tl.float32)) + gi, sc, mask=gi < L // 128)
            elif FMT == 1:
                tl.store(row + cols, tl.clamp(kv_c.to(tl.float32) / kv_scale, -448.0, 448.0).to(tl.float8e4nv),
                         mask=m)
            else:
                tl.store(row + cols, kv_c.to(CACHE.dtype.element_ty), mask=m)
        # rope pair j of R/2 at this token's position (fp32 math, one rounding)
        j = tl.arange(0, BR2)
        jm = j < R // 2
        pos = tl.load(POS + t).to(tl.int64)
        c = tl.load(COS + pos * (R // 2) + j, mask=jm, other=0.0)
        s = tl.load(SIN + pos * (R // 2) + j, mask=jm, other=0.0)
        p1, p2 = _pair_ptrs(KVA + t * s_kva + L, j, R // 2, INTERLEAVE)
        x1 = tl.load(p1, mask=jm, other=0.0).to(tl.float32)
        x2 = tl.load(p2, mask=jm, other=0.0).to(tl.float32)
        r1 = (x1 * c - x2 * s).to(LAT.dtype.element_ty)
        r2 = (x2 * c + x1 * s).to(LAT.dtype.element_ty)
        d1, d2 = _pair_ptrs(LAT + t * s_lat + L, j, R // 2, INTERLEAVE)
        tl.store(d1, r1, mask=jm)
        tl.store(d2, r2, mask=jm)
        if WRITE_CACHE:
            if FMT == 2:
                d1, d2 = _pair_ptrs((row + L + 4 * (L // 128)).to(tl.pointer_type(tl.bfloat16)), j, R // 2, INTERLEAVE)
                tl.store(d1, r1.to(tl.bfloat16), mask=jm)
                tl.store(d2, r2.to(tl.bfloat16), mask=jm)
            elif FMT == 1:
                d1, d2 = _pair_ptrs(row + L, j, R // 2, INTERLEAVE)
                tl.store(d1, tl.clamp(r1.to(tl.float32) / kv_scale, -448.0, 448.0).to(tl.float8e4nv), mask=jm)
                tl.store(d2, tl.clamp(r2.to(tl.float32) / kv_scale, -448.0, 448.0).to(tl.float8e4nv), mask=jm)
            else:
                d1, d2 = _pair_ptrs(row + L, j, R // 2, INTERLEAVE)
                tl.store(d1, r1.to(CACHE.dtype.element_ty), mask=jm)
                tl.store(d2, r2.to(CACHE.dtype.element_ty), mask=jm)
        for h in range(H):  # q_pe of every head, rotated in place in q
            q1, q2 = _pair_ptrs(Q + t * s_q_t + h * s_q_h + NOPE, j, R // 2, INTERLEAVE)
            a = tl.load(q1, mask=jm, other=0.0)
            b = tl.load(q2, mask=jm, other=0.0)
            af, bf = a.to(tl.float32), b.to(tl.float32)
            tl.store(q1, (af * c - bf * s).to(a.dtype), mask=jm)
            tl.store(q2, (bf * c + af * s).to(a.dtype), mask=jm)


def supported(x: torch.Tensor) -> bool:
    return HAS_TRITON and x.is_cuda


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of x (or of x + residual) [T, D] -> (normed [T, D] in weight's dtype rules, x + residual or None)."""
    t, d = x.shape
    out = torch.empty(t, d, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    res_out = torch.empty_like(x) if residual is not None else None
    if t:
        res = residual if residual is not None else x
        ro = res_out if res_out is not None else out
        _rms_norm[(t,)](x, res, weight, out, ro, x.stride(0), res.stride(0), out.stride(0), ro.stride(0), d, eps,
                        BD=triton.next_power_of_2(d), HAS_RES=residual is not None,
                        num_warps=4 if d <= 4096 else 8)
    return out, res_out


def mla_latent(kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float, kv_lora_rank: int, positions: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, interleave: bool, q: torch.Tensor, nope: int,
               cache: torch.Tensor | None = None, slots: torch.Tensor | None = None,
               kv_format: KVFormat | None = None) -> torch.Tensor:
    """kv_a [T, L+R] (kv_a_proj's output) -> latent [T, L+R] = [rms_norm(kv_c) | rope(k_pe)]; q [T, H, nope+R]
    gets its rope part rotated in place; with ``cache`` (flat [slots, row width]) and ``slots`` [T] each
    latent row is also written to its cache slot, stored as ``kv_format`` says (default: as is)."""
    t, width = kv_a.shape
    rope = width - kv_lora_rank
    latent = torch.empty(t, width, dtype=kv_a.dtype, device=kv_a.device)
    if t == 0:
        return latent
    if kv_a.stride(-1) != 1 or q.stride(-1) != 1 or q.shape[-1] != nope + rope or cos.shape[-1] * 2 != rope:
        raise ValueError(f"mla_latent: kv_a {tuple(kv_a.shape)}, q {tuple(q.shape)}, cos {tuple(cos.shape)}")
    write = cache is not None and slots is not None
    cache_stride = cache.stride(0) if cache is not None and write else 0
    fmt = KERNEL_CODE[kv_format.name] if kv_format is not None else 0
    if cache is not None and write and kv_format is not None:
        kv_format.check_cache(cache, "mla_latent")
    _mla_latent[(t,)](
        kv_a, norm_weight, positions, cos, sin, q, latent, cache if write else latent, slots if write else positions,
        kv_a.stride(0), q.stride(0), q.stride(1), latent.stride(0), cache_stride, q.shape[1], eps,
        kv_format.scale if kv_format is not None else 1.0,
        L=kv_lora_rank, BL=triton.next_power_of_2(kv_lora_rank), R=rope, BR2=triton.next_power_of_2(rope // 2),
        NOPE=nope, INTERLEAVE=interleave, WRITE_CACHE=write, FMT=fmt, num_warps=4,
    )
    return latent
