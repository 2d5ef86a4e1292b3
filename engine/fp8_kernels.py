"""Block-FP8 compute on CUDA (W8A8): activations quantized per token in groups of 128 channels, and a GEMM
of those against a weight in DeepSeek's 128 x 128 block format, both as Triton kernels of ours.

``quantize_groups(x)`` -> (``q`` e4m3 [M, K], ``s`` float32 [M, ceil(K/128)]): each group's largest magnitude
maps to e4m3's 448 (``x ≈ q * s``). ``gemm(q, s, w, w_scale)`` -> ``x @ w.T`` in bf16: every 128-wide step
of the inner dimension is one FP8 tensor-core product of a tile of ``q`` and a tile of ``w``, scaled by
the step's activation scale per row and weight scale per column, and summed in fp32. ``fused_experts``
in ``engine.moe_kernels`` runs the routed experts the same way, with ``quantize_groups`` on its input.

The engine runs only the routed experts in FP8 (``engine.fp8_compute`` says why): ``gemm`` and ``linear``
are the dense W8A8 GEMM that ``benchmarks/fp8_gemm.py`` measures against cuBLAS bf16 and torch's
block-scaled ``_scaled_mm``, and tests/gpu/test_fp8_gpu.py checks. Everything is shaped by the tensors'
shapes only, so the kernels are capturable in CUDA graphs. Triton is optional: without it ``HAS_TRITON``
is False and FP8 checkpoints are dequantized at load.
"""

# ruff: noqa: ANN001  (Triton kernel arguments are pointers and ints, typed by the JIT, not annotations)
from __future__ import annotations

import functools

import torch

from engine.fp8 import FP8_DTYPE, FP8_MAX

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    HAS_TRITON = False

GROUP = 128  # channels per activation scale; the weight's block edge
_MIN_AMAX = 1e-10  # an all-zero group still gets a finite scale
# Tiles by rows of the product (benchmarks/fp8_gemm.py --sweep on an H200): (BM, BN, warps, stages).
_TILES = ((16, 32, 4, 4), (32, 64, 4, 4), (64, 64, 4, 4), (128, 128, 8, 3))

if HAS_TRITON:

    @triton.jit
    def quantize_rows(x):  # noqa: ANN201  (a Triton function: it returns tensors typed by the JIT)
        # x [R, G] fp32, one group a row -> (x / s clamped to e4m3's range, still fp32; s [R]): each row's largest
        # magnitude maps to 448 (an all-zero row gets a finite scale). The fused MoE's gate-up epilogues use it too.
        s = tl.maximum(tl.max(tl.abs(x), 1), 1e-10) / 448.0
        return tl.clamp(x / s[:, None], -448.0, 448.0), s

    @triton.jit
    def _quantize_groups(X, Q, S, M, K, s_x, s_sm, s_sg, ROWS: tl.constexpr, G: tl.constexpr):
        # program (row block, group): ROWS rows x one group of G channels; row r's scale of group g at
        # S + r * s_sm + g * s_sg
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        g = tl.program_id(1)
        cols = g * G + tl.arange(0, G)
        rmask = rows < M
        m = rmask[:, None] & (cols < K)[None, :]
        x = tl.load(X + rows[:, None].to(tl.int64) * s_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        q, s = quantize_rows(x)
        tl.store(Q + rows[:, None].to(tl.int64) * K + cols[None, :], q.to(Q.dtype.element_ty), mask=m)
        tl.store(S + rows * s_sm + g * s_sg, s, mask=rmask)

    @triton.jit
    def step_scales(XS, rmask, WS1, WS2, kb):  # noqa: ANN201  (a Triton function, as quantize_rows)
        # One K step's FP8 scales: the rows' activation scales XS[:, kb] ([BM]; 0 for masked rows) and the two
        # weight blocks' WS1[kb], WS2[kb]. The kernels load step k + 1's while step k's dots run and carry them:
        # loaded where they are used, the scales are plain global loads the pipeliner does not stage, and every
        # step waited for them before its dots (one global latency a step; docs/benchmarks.md).
        return tl.load(XS + kb, mask=rmask, other=0.0), tl.load(WS1 + kb), tl.load(WS2 + kb)

    @triton.jit
    def _gemm(A, AS, B, BS, C, M, N, K, NKB, s_a, s_c,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
        # C [M, N] = A [M, K] (row scales per K block, AS [M, NKB]) x B [N, K]^T (block scales BS [N/BK, NKB])
        tl.static_assert(BN <= BK)
        pid = tl.program_id(0)
        grid_m = tl.cdiv(M, BM)
        grid_n = tl.cdiv(N, BN)
        width = GROUP_M * grid_n  # programs of GROUP_M row tiles walk the column tiles together (L2 reuse)
        first_m = (pid // width) * GROUP_M
        size_m = tl.minimum(grid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % size_m
        pid_n = (pid % width) // size_m
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        rmask = rows < M
        cmask = cols < N
        acc = tl.zeros([BM, BN], tl.float32)
        bs = BS + (pid_n * BN // BK) * NKB  # the tile's columns lie in one weight block (BN <= BK)
        sa, sb, _ = step_scales(AS + rows * NKB, rmask, bs, bs, 0)
        for kb in range(0, NKB):
            ks = kb * BK + tl.arange(0, BK)
            kmask = ks < K
            a = tl.load(A + rows[:, None].to(tl.int64) * s_a + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                        other=0.0)
            b = tl.load(B + cols[None, :].to(tl.int64) * K + ks[:, None], mask=kmask[:, None] & cmask[None, :],
                        other=0.0)  # [BK, BN]
            sa_n, sb_n, _ = step_scales(AS + rows * NKB, rmask, bs, bs, tl.minimum(kb + 1, NKB - 1))
            acc += tl.dot(a, b) * (sa * sb)[:, None]
            sa, sb = sa_n, sb_n
        tl.store(C + rows[:, None].to(tl.int64) * s_c + cols[None, :], acc.to(C.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])


@functools.cache
def sm90(device_index: int) -> bool:
    """Whether this CUDA device is sm90 (Hopper), the one arch DeepGEMM's and FlashMLA's Hopper kernels run on."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


@functools.cache
def supported(device_index: int) -> bool:
    """Whether FP8 compute runs on this CUDA device: Triton and FP8 tensor cores (sm89 / Hopper or newer)."""
    return HAS_TRITON and torch.cuda.get_device_capability(device_index) >= (8, 9)


def quantize_groups(x: torch.Tensor, mn_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K/128)]), per token and group of 128 channels. With
    ``mn_major`` the scales are a view of a ``[ceil(K/128), M']`` buffer (M' = M rounded up to 4: 16-byte rows),
    the layout DeepGEMM's sm90 kernels read (``engine.dense_deep_gemm``)."""
    m, k = x.shape
    if x.stride(-1) != 1:
        raise ValueError("quantize_groups needs rows with unit stride")
    ng = triton.cdiv(k, GROUP)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    if mn_major:
        mp = triton.cdiv(m, 4) * 4
        s = torch.empty(ng, mp, dtype=torch.float32, device=x.device)[:, :m].t()
    else:
        s = torch.empty(m, ng, dtype=torch.float32, device=x.device)
    if m:
        rows = 8
        _quantize_groups[(triton.cdiv(m, rows), ng)](x, q, s, m, k, x.stride(0), s.stride(0), s.stride(1), ROWS=rows,
                                                     G=GROUP, num_warps=4)
    return q, s


def _tile(m: int) -> tuple[int, int, int, int]:
    for tile in _TILES:
        if m <= tile[0]:
            return tile
    return _TILES[-1]


def gemm(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(q, s) from ``quantize_groups`` [M, K] times the block-FP8 weight ``w`` [N, K] (``w_scale``
    [ceil(N/128), ceil(K/128)]) transposed -> [M, N] in ``out_dtype``."""
    m, k = q.shape
    n = w.shape[0]
    nkb = triton.cdiv(k, GROUP)
    if w.shape[1] != k or tuple(w_scale.shape) != (triton.cdiv(n, GROUP), nkb) or not w.is_contiguous():
        raise ValueError(f"fp8 gemm: x {tuple(q.shape)}, w {tuple(w.shape)}, scale {tuple(w_scale.shape)}")
    out = torch.empty(m, n, dtype=out_dtype, device=q.device)
    if m == 0:
        return out
    bm, bn, warps, stages = _tile(m)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _gemm[grid](q, s, w, w_scale, out, m, n, k, nkb, q.stride(0), out.stride(0),
                BM=bm, BN=bn, BK=GROUP, GROUP_M=8, num_warps=warps, num_stages=stages)
    return out


def linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` (x [M, K] in bf16 or fp32) with the activations quantized per token group, in x's dtype."""
    q, s = quantize_groups(x)
    return gemm(q, s, w, w_scale, x.dtype)


def reference_groups(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernels see it after quantizing it per row and group of 128 channels (``quantize_rows``),
    dequantized, in fp32 torch (for tests)."""
    m, k = x.shape
    ng = -(-k // GROUP)
    pad = torch.zeros(m, ng * GROUP, dtype=torch.float32, device=x.device)
    pad[:, :k] = x.float()
    g = pad.view(m, ng, GROUP)
    s = g.abs().amax(-1).clamp(min=_MIN_AMAX) / FP8_MAX
    xq = (g / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * s[..., None]
    return xq.view(m, -1)[:, :k]


def reference_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """What ``linear`` computes, in fp32 torch (for tests): both operands dequantized after the same
    quantization of the activations."""
    from engine.fp8 import dequantize_blocks

    return reference_groups(x) @ dequantize_blocks(w, w_scale).T
