"""Routed experts at decode batch sizes as three Triton kernels (route, gate-up, down): a fused MoE;
and at every size, the expert outputs' weighted sum per token (``combine``) and ``silu_mul``.

At decode sizes each expert sees a few rows, so the routed experts' cost is reading their weights:
what matters is reading each used expert's weights once, at full bandwidth, and launching few kernels.
For ``T`` tokens choosing ``K`` experts each (``N = T*K`` rows):

1. ``engine.moe_routing.route``: counts rows per expert, and gives every (token, choice) its row in expert
   order, without a sort: ``offs`` [E+1] (expert e's rows are ``offs[e]:offs[e+1]``),
   ``src`` [N] (row -> token) and ``order`` [N] (row -> flat (token, choice) index).
2. ``_moe_gate_up``: program (column tile, row tile) serves one tile of up to ``BLOCK_M`` rows of one
   expert (``_row_tile``: expert e's rows make ``cdiv(rows, BLOCK_M)`` tiles, numbered in expert order), so
   an expert with many rows is spread over many programs, as in a grouped GEMM; it loads the expert's gate
   and up weight tiles, reads its rows' inputs straight from ``x`` through ``src``, and writes
   ``silu(gate) * up`` (fp32 math, one rounding). Column tiles vary fastest: the programs reading one row
   tile run together and share it in L2. Programs past the last row tile exit.
3. ``_moe_down``: the same over ``w2``; each row's output is written to its (token, choice) slot, where
   ``combine`` reads it for the weighted sum over choices.

Block-FP8 experts run these kernels at every size, and from ``FP8_TMA_MIN_ROWS`` rows an expert on Hopper
(prefill) a second pair, ``_moe_gate_up_tma`` and ``_moe_down_tma``: every weight tile arrives through TMA (a
host tensor descriptor over all experts' weights), the gate-up's input rows by ``cp.async`` through ``src``
and the down's (already in expert order) through TMA too.

4. ``_moe_combine``: program (token, column chunk) sums the token's K expert rows, each times its router
   weight, in fp32, plus the shared experts' output, and rounds once: the weighted sum and the add in
   one pass (torch needs a permutation copy, a batched [1, K] x [K, D] product and an add; at prefill
   sizes those took a tenth of the step, docs/benchmarks.md).

A choice of an id past the experts (``>= E``) is skipped: no row computes it and its output slot is left
unwritten (under expert parallelism a CUDA graph's MoE passes every gathered choice, those of other ranks'
experts as ``E``: ``engine.layers.MoE``).

Everything is shaped by ``E``, the weight shapes and ``N`` only (never by device values), so the
kernels are capturable in a CUDA graph. Triton is optional: without it ``HAS_TRITON`` is False.
"""

# ruff: noqa: ANN001  (Triton kernel arguments are pointers and ints, typed by the JIT, not annotations)
from __future__ import annotations

import functools

import torch

from engine import moe_deep_gemm
from engine.fp8 import FP8_DTYPE
from engine.fp8_kernels import GROUP as FP8_GROUP
from engine.fp8_kernels import quantize_groups
from engine.moe_routing import route

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs: the MoE keeps its torch paths
    HAS_TRITON = False
try:
    from triton.tools.tensor_descriptor import TensorDescriptor

    HAS_TMA = True
except ImportError:  # Triton without host tensor descriptors: the FP8 experts keep one form at every size
    HAS_TMA = False

# Tuning (benchmarks/moe.py sweeps them; H200, V2-Lite's experts): rows per tile (None: from the rows per
# expert, 16 to 64), output columns per tile, inner-dimension step.
BLOCK_M: int | None = None
BLOCK_N = 64
BLOCK_K = 128
NUM_WARPS = 4
NUM_STAGES = 4
# FP8 experts: the gate-up tile is 128 columns wide (one activation group, quantized in the kernel): two
# [BM, 128] fp32 sums per program. By rows per expert (at most): (rows per tile, gate-up warps, stages,
# down columns per tile, down warps); benchmarks/fp8_gemm.py --sweep on an H200. The FP8_* knobs below,
# when set, override the table (the sweep sets them).
FP8_TILES: tuple[tuple[float, tuple[int, int, int, int, int]], ...] = (
    (1.0, (16, 8, 4, 64, 4)),
    (8.0, (16, 4, 3, 64, 4)),
    (32.0, (64, 8, 4, 64, 4)),
    (float("inf"), (64, 8, 3, 64, 4)),
)
FP8_BLOCK_M: int | None = None
FP8_WARPS: int | None = None
FP8_STAGES: int | None = None
FP8_DOWN_BN: int | None = None
FP8_DOWN_WARPS: int | None = None
# FP8 experts at prefill sizes (from this many (token, choice) rows an expert on average, on Hopper): weight tiles
# come in through TMA (no pointer tensors of theirs in registers), which leaves room for 128-row gate-up tiles.
# (gate-up rows, warps, stages; down rows, columns, warps, stages); sweeps on an H100 (docs/benchmarks.md, 2026-12-06
# fourth session: 1.29x / 1.34x the fused form at 4,096 / 16,384 tokens; sixth: 3 gate-up stages, once the scales
# were loaded a step ahead, 1.03x / 1.05x over 4).
FP8_TMA_MIN_ROWS = 64.0
FP8_TMA_TILES = (128, 8, 3, 64, 128, 4, 4)
# The TMA gate-up keeps its sums in the tensor cores' accumulator from block to block; Hopper's FP8 MMA adds into it
# in reduced precision, so over a whole row (2,048 to 7,168 channels) the sums drift. Promoted, each 128-block's
# product is summed apart and added in fp32, as every other form of ours (and DeepSeek's recipe) does: 2.7-4x
# closer to fp32 sums, ~2% of a 4k prefill (docs/benchmarks.md, 2026-12-06 seventh session).
FP8_TMA_PROMOTE = True
MAX_ROWS = 4096  # above this many (token, choice) rows the caller's grouped GEMM is the better tool

if HAS_TRITON:
    from engine.fp8_kernels import quantize_rows, step_scales

    # Weight scales floored in the rescaled FP8 sums, which divide by them (an all-zero block).
    _MIN_WS = tl.constexpr(1e-12)

    @triton.jit
    def _silu_store(gate, up, rows, rmask, cols, cmask, tile, OUT, OUTS, INTER, NG, QUANT: tl.constexpr):
        # The gate-up epilogue: silu(gate) * up in fp32 written to OUT [N, INTER]; QUANT: the tile's columns are
        # one group of 128, each row's group quantized here, its scale to OUTS [N, NG] at column ``tile``.
        h = gate / (1.0 + tl.exp(-gate)) * up
        omask = rmask[:, None] & cmask[None, :]
        if QUANT:
            h, s = quantize_rows(tl.where(omask, h, 0.0))
            tl.store(OUTS + rows.to(tl.int64) * NG + tile, s, mask=rmask)
        tl.store(OUT + rows[:, None].to(tl.int64) * INTER + cols[None, :], h.to(OUT.dtype.element_ty), mask=omask)

    @triton.jit
    def _row_tile(OFFS, b, E, EP: tl.constexpr, BM: tl.constexpr):
        # Row tile b of all experts' tiles (expert e's rows OFFS[e]:OFFS[e+1] make cdiv(rows, BM) tiles, in
        # expert order) -> (expert, first row, end row); past the last tile an empty range (end <= first).
        experts = tl.arange(0, EP)
        emask = experts < E
        lo = tl.load(OFFS + experts, mask=emask, other=0)
        hi = tl.load(OFFS + 1 + experts, mask=emask, other=0)
        tiles = (hi - lo + BM - 1) // BM
        ends = tl.cumsum(tiles, 0)
        e = tl.sum((ends <= b).to(tl.int32), 0)
        sel = experts == e
        m0 = tl.sum(tl.where(sel, lo + (b - ends + tiles) * BM, 0), 0)
        m1 = tl.minimum(m0 + BM, tl.sum(tl.where(sel, hi, 0), 0))  # e == E: no expert selected, m1 = 0
        return e, m0, m1

    @triton.jit
    def _moe_gate_up(X, XS, SRC, OFFS, W, WS, OUT, OUTS, s_x, D, INTER, NKB, SBI, E,
                     EP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                     FP8: tl.constexpr):
        # FP8: X e4m3 with per-token scales XS [T, NKB] (one per BK = 128 channels), W e4m3 with block scales
        # WS [E, 2 * SBI, NKB] (gate_proj's SBI row blocks, then up_proj's); the output is quantized per row
        # over its BN = 128 columns (one group) into OUT e4m3 and OUTS [N, cdiv(INTER, 128)].
        tl.static_assert(not FP8 or BN == BK)  # FP8: the tile's columns are one weight block and one group
        tile = tl.program_id(0)
        e, start, end = _row_tile(OFFS, tl.program_id(1), E, EP, BM)
        cols = tile * BN + tl.arange(0, BN)
        cmask = cols < INTER
        w = W + e.to(tl.int64) * (2 * INTER * D)  # expert e: [2I, D], gate rows then up rows
        wsg = WS + e.to(tl.int64) * (2 * SBI * NKB) + tile * NKB  # FP8: the tile's gate block's scales
        wsu = wsg + SBI * NKB  # and its up block's
        for m0 in range(start, end, BM):  # one tile, or none
            rows = m0 + tl.arange(0, BM)
            rmask = rows < end
            tok = tl.load(SRC + rows, mask=rmask, other=0).to(tl.int64)
            xs = XS + tok * NKB
            gate = tl.zeros([BM, BN], tl.float32)
            up = tl.zeros([BM, BN], tl.float32)
            if FP8:  # the first step's scales; each step loads the next one's (see fp8_kernels.step_scales)
                sa, sg, su = step_scales(xs, rmask, wsg, wsu, 0)
            for k0 in range(0, D, BK):
                ks = k0 + tl.arange(0, BK)
                kmask = ks < D
                a = tl.load(X + tok[:, None] * s_x + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
                wmask = kmask[:, None] & cmask[None, :]
                wg = tl.load(w + cols[None, :].to(tl.int64) * D + ks[:, None], mask=wmask, other=0.0)  # [BK, BN]
                wu = tl.load(w + (cols[None, :] + INTER).to(tl.int64) * D + ks[:, None], mask=wmask, other=0.0)
                if FP8:
                    sa_n, sg_n, su_n = step_scales(xs, rmask, wsg, wsu, tl.minimum(k0 // BK + 1, NKB - 1))
                    gate += tl.dot(a, wg) * (sa * sg)[:, None]
                    up += tl.dot(a, wu) * (sa * su)[:, None]
                    sa, sg, su = sa_n, sg_n, su_n
                else:
                    gate = tl.dot(a, wg, acc=gate, input_precision=PREC)
                    up = tl.dot(a, wu, acc=up, input_precision=PREC)
            _silu_store(gate, up, rows, rmask, cols, cmask, tile, OUT, OUTS, INTER, tl.cdiv(INTER, BN), FP8)

    @triton.jit
    def _moe_down(A, AS, ORDER, OFFS, W, WS, OUT, D, INTER, NKB, SBD, E,
                  EP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                  FP8: tl.constexpr):
        # FP8: A e4m3 with row scales AS [N, NKB] (NKB = cdiv(INTER, 128)), W e4m3 with WS [E, SBD, NKB]
        tl.static_assert(not FP8 or BN <= BK)
        cols = tl.program_id(0) * BN + tl.arange(0, BN)
        e, start, end = _row_tile(OFFS, tl.program_id(1), E, EP, BM)
        cmask = cols < D
        w = W + e.to(tl.int64) * (D * INTER)  # expert e: [D, INTER]
        # FP8: the tile's columns lie in one weight block (BN <= BK, tiles aligned): one scale a step
        wsb = WS + e.to(tl.int64) * (SBD * NKB) + (tl.program_id(0) * BN // BK) * NKB
        for m0 in range(start, end, BM):  # one tile, or none
            rows = m0 + tl.arange(0, BM)
            rmask = rows < end
            acc = tl.zeros([BM, BN], tl.float32)
            as_ = AS + rows.to(tl.int64) * NKB
            if FP8:  # the first step's scales; each step loads the next one's (see fp8_kernels.step_scales)
                sa, sb, _ = step_scales(as_, rmask, wsb, wsb, 0)
            for k0 in range(0, INTER, BK):
                ks = k0 + tl.arange(0, BK)
                kmask = ks < INTER
                a = tl.load(A + rows[:, None].to(tl.int64) * INTER + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                            other=0.0)
                wd = tl.load(w + cols[None, :].to(tl.int64) * INTER + ks[:, None], mask=kmask[:, None] & cmask[None, :],
                             other=0.0)
                if FP8:
                    sa_n, sb_n, _ = step_scales(as_, rmask, wsb, wsb, tl.minimum(k0 // BK + 1, NKB - 1))
                    acc += tl.dot(a, wd) * (sa * sb)[:, None]
                    sa, sb = sa_n, sb_n
                else:
                    acc = tl.dot(a, wd, acc=acc, input_precision=PREC)
            dest = tl.load(ORDER + rows, mask=rmask, other=0).to(tl.int64)
            tl.store(OUT + dest[:, None] * D + cols[None, :], acc.to(OUT.dtype.element_ty),
                     mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def _moe_gate_up_tma(X, XS, SRC, OFFS, WD, WS, OUT, OUTS, s_x, D, INTER, NKB, SBI, E,
                         EP: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, IMPRECISE: tl.constexpr):
        # _moe_gate_up's FP8 form with WD a descriptor of all experts' w13 as [E * 2I, D]: the e4m3 rows X [T, D]
        # (scales XS [T, NKB]) are read through SRC as in _moe_gate_up; tiles of BK = 128 columns (one weight
        # block, one output group). (Gathering the rows into expert order first, for a TMA descriptor of
        # them too, measured no faster and held a copy of every (token, choice) row.)
        tile = tl.program_id(0)
        e, start, end = _row_tile(OFFS, tl.program_id(1), E, EP, BM)
        cols = tile * BK + tl.arange(0, BK)
        cmask = cols < INTER
        wsg = WS + e.to(tl.int64) * (2 * SBI * NKB) + tile * NKB  # the tile's gate block's scales
        wsu = wsg + SBI * NKB  # and its up block's
        wrow = e * (2 * INTER) + tile * BK
        for m0 in range(start, end, BM):  # one tile, or none
            rows = m0 + tl.arange(0, BM)
            rmask = rows < end
            # The sums are kept divided by the last step's scales (sa_ per row, sg_ / su_ for the tile's weight
            # block): each step rescales them once and its product accumulates in place, so no second
            # [BM, BK] of registers per sum (the product-then-scale form spills at 128 rows).
            gate = tl.zeros([BM, BK], tl.float32)
            up = tl.zeros([BM, BK], tl.float32)
            sa_ = tl.full([BM], 1.0, tl.float32)
            sg_ = 1.0
            su_ = 1.0
            tok = tl.load(SRC + rows, mask=rmask, other=0).to(tl.int64)
            xs = XS + tok * NKB
            sa, sg, su = step_scales(xs, rmask, wsg, wsu, 0)
            for k0 in range(0, D, BK):
                ks = k0 + tl.arange(0, BK)
                a = tl.load(X + tok[:, None] * s_x + ks[None, :], mask=rmask[:, None] & (ks < D)[None, :], other=0.0)
                wg = WD.load([wrow, k0])
                wu = WD.load([wrow + INTER, k0])
                sa_n, sg_n, su_n = step_scales(xs, rmask, wsg, wsu, tl.minimum(k0 // BK + 1, NKB - 1))
                sa = tl.where(rmask, sa, 1.0)
                sg = tl.maximum(sg, _MIN_WS)
                su = tl.maximum(su, _MIN_WS)
                ra = sa_ / sa
                # IMPRECISE = BK: each block's product summed apart, then added in fp32 (see FP8_TMA_PROMOTE)
                gate = tl.dot(a, wg.T, acc=gate * (ra * (sg_ / sg))[:, None], max_num_imprecise_acc=IMPRECISE)
                up = tl.dot(a, wu.T, acc=up * (ra * (su_ / su))[:, None], max_num_imprecise_acc=IMPRECISE)
                sa_, sg_, su_ = sa, sg, su
                sa, sg, su = sa_n, sg_n, su_n
            gate *= (sa_ * sg_)[:, None]
            up *= (sa_ * su_)[:, None]
            _silu_store(gate, up, rows, rmask, cols, cmask, tile, OUT, OUTS, INTER, tl.cdiv(INTER, BK), True)

    @triton.jit
    def _moe_down_tma(AD, AS, ORDER, OFFS, WD, WS, OUT, D, INTER, NKB, SBD, E,
                      EP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # _moe_down's FP8 form with AD a descriptor of the gate-up's e4m3 rows [N, INTER], WD one of all
        # experts' w2 as [E * D, INTER]; here the product-then-scale form is the faster one (64-row tiles).
        tl.static_assert(BN <= BK)  # the tile's columns lie in one weight block: one weight scale a step
        cols = tl.program_id(0) * BN + tl.arange(0, BN)
        e, start, end = _row_tile(OFFS, tl.program_id(1), E, EP, BM)
        cmask = cols < D
        wsb = WS + e.to(tl.int64) * (SBD * NKB) + (tl.program_id(0) * BN // BK) * NKB  # one block (BN <= BK)
        wrow = e * D + tl.program_id(0) * BN
        for m0 in range(start, end, BM):  # one tile, or none
            rows = m0 + tl.arange(0, BM)
            rmask = rows < end
            acc = tl.zeros([BM, BN], tl.float32)
            as_ = AS + rows.to(tl.int64) * NKB
            sa, sb, _ = step_scales(as_, rmask, wsb, wsb, 0)
            for k0 in range(0, INTER, BK):
                a = AD.load([m0, k0])
                w = WD.load([wrow, k0])
                sa_n, sb_n, _ = step_scales(as_, rmask, wsb, wsb, tl.minimum(k0 // BK + 1, NKB - 1))
                acc += tl.dot(a, w.T) * (sa * sb)[:, None]
                sa, sb = sa_n, sb_n
            dest = tl.load(ORDER + rows, mask=rmask, other=0).to(tl.int64)
            tl.store(OUT + dest[:, None] * D + cols[None, :], acc.to(OUT.dtype.element_ty),
                     mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def _moe_combine(Y, ROW, WT, SHARED, OUT, D, K: tl.constexpr, BD: tl.constexpr, HAS_ROW: tl.constexpr,
                     HAS_SHARED: tl.constexpr, SLOTS: tl.constexpr):
        # SLOTS: each token's Y row holds K + SLOTS outputs, the last SLOTS the shared experts' (weight 1)
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BD + tl.arange(0, BD)
        cmask = cols < D
        # HAS_ROW: ROW [T, K + SLOTS] gives each output's row of Y, -1 for a skipped choice (read as 0)
        acc = tl.zeros([BD], tl.float32)
        for j in tl.static_range(K):
            if HAS_ROW:
                r = tl.load(ROW + t * (K + SLOTS) + j).to(tl.int64)
                rm = cmask & (r >= 0)
            else:
                r = t * (K + SLOTS) + j
                rm = cmask
            w = tl.load(WT + t * K + j).to(tl.float32)
            acc += w * tl.load(Y + r * D + cols, mask=rm, other=0.0).to(tl.float32)
        for j in tl.static_range(SLOTS):
            if HAS_ROW:
                r = tl.load(ROW + t * (K + SLOTS) + K + j).to(tl.int64)
            else:
                r = t * (K + SLOTS) + K + j
            acc += tl.load(Y + r * D + cols, mask=cmask, other=0.0).to(tl.float32)
        if HAS_SHARED:
            acc += tl.load(SHARED + t * D + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(OUT + t * D + cols, acc.to(OUT.dtype.element_ty), mask=cmask)

    @triton.jit
    def _silu_mul(H, OUT, TOTAL, INTER, BLOCK: tl.constexpr):
        # program: BLOCK consecutive elements of the [N, I] output, whatever rows they span
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = idx < TOTAL
        r = idx // INTER
        src = idx + r * INTER  # row r's gate column c sits at r * 2I + c, its up column I further
        gate = tl.load(H + src, mask=m, other=0.0).to(tl.float32)
        up = tl.load(H + src + INTER, mask=m, other=0.0).to(tl.float32)
        tl.store(OUT + idx, (gate / (1.0 + tl.exp(-gate)) * up).to(OUT.dtype.element_ty), mask=m)


def supported(x: torch.Tensor, num_rows: int) -> bool:
    """Whether the fused kernels serve this call: CUDA, Triton, at most MAX_ROWS (token, choice) rows."""
    return HAS_TRITON and x.is_cuda and 0 < num_rows <= MAX_ROWS


def fused_experts(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                  shared: int = 0) -> torch.Tensor:
    """x [T, D], expert ids [T, K], w13 [E, 2I, D] (gate rows, then up rows), w2 [E, D, I]
    -> each (token, choice)'s expert output [T, K, D] in x's dtype (unweighted); a choice of id ``>= E`` is
    skipped, its slot left unwritten. With ``shared`` (S), the stack's last S experts are ones every token
    chooses besides its K (the shared experts: ``engine.layers.MoE.hold_fp8``): ids name the first E - S, and
    the output is [T, K + S, D], the shared experts' outputs last.

    Block-FP8 experts (W8A8): w13 and w2 in e4m3 with their ``weight_scale_inv`` stacks, ``w13_scale``
    [E, 2 * cdiv(I, 128), cdiv(D, 128)] (gate_proj's blocks, then up_proj's) and ``w2_scale``
    [E, cdiv(D, 128), cdiv(I, 128)]. ``x`` is quantized per token in groups of 128 channels first, and the
    gate-up kernel quantizes its output the same way as it writes it (its column tile is one group)."""
    t, k = ids.shape
    e, two_i, d = w13.shape
    i = two_i // 2
    n = t * (k + shared)
    if x.stride(-1) != 1 or not w13.is_contiguous() or not w2.is_contiguous() or w2.shape != (e, d, i):
        raise ValueError(f"fused_experts: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    dev = x.device
    offs, src, order = route(ids, e - shared, shared)
    ep = triton.next_power_of_2(e)
    out = torch.empty(t, k + shared, d, dtype=x.dtype, device=dev)
    if w13.dtype == FP8_DTYPE:
        if w13_scale is None or w2_scale is None:
            raise ValueError("fused_experts: FP8 experts need their weight_scale_inv stacks")
        g = FP8_GROUP
        sbi, nkd, nki = -(-i // g), -(-d // g), -(-i // g)
        if tuple(w13_scale.shape) != (e, 2 * sbi, nkd) or tuple(w2_scale.shape) != (e, nkd, nki):
            raise ValueError(f"fused_experts: scales {tuple(w13_scale.shape)}, {tuple(w2_scale.shape)} for w13 "
                             f"{tuple(w13.shape)}, w2 {tuple(w2.shape)}")
        xq, xs = quantize_groups(x)
        if tma_form(x, n, e, d, i):
            _fp8_experts_tma(xq, xs, src, order, offs, w13, w2, w13_scale, w2_scale, out)
            return out
        bm, warps, stages, down_bn, down_warps = fp8_tiles(n, e)
        act = torch.empty(n, i, dtype=FP8_DTYPE, device=dev)
        act_s = torch.empty(n, nki, dtype=torch.float32, device=dev)
        _moe_gate_up[(nki, row_tiles(n, e, bm))](
            xq, xs, src, offs, w13, w13_scale, act, act_s, xq.stride(0), d, i, nkd, sbi, e,
            EP=ep, BM=bm, BN=g, BK=g, PREC="ieee", FP8=True, num_warps=warps, num_stages=stages)
        _moe_down[(triton.cdiv(d, down_bn), row_tiles(n, e, bm))](
            act, act_s, order, offs, w2, w2_scale, out, d, i, nki, nkd, e,
            EP=ep, BM=bm, BN=down_bn, BK=g, PREC="ieee", FP8=True, num_warps=down_warps, num_stages=stages)
        return out
    # A tile of rows per expert's average share: each extra tile of an expert re-reads its weights.
    bm = BLOCK_M or _auto_block_m(n, e)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32: exact products
    # fp32 tiles take twice the shared memory per stage: a shorter K step and two stages fit
    bk, stages = (BLOCK_K, NUM_STAGES) if x.element_size() <= 2 else (min(BLOCK_K, 64), 2)
    act = torch.empty(n, i, dtype=x.dtype, device=dev)
    _moe_gate_up[(triton.cdiv(i, BLOCK_N), row_tiles(n, e, bm))](
        x, x, src, offs, w13, w13, act, act, x.stride(0), d, i, 0, 0, e,
        EP=ep, BM=bm, BN=BLOCK_N, BK=bk, PREC=prec, FP8=False, num_warps=NUM_WARPS, num_stages=stages)
    _moe_down[(triton.cdiv(d, BLOCK_N), row_tiles(n, e, bm))](
        act, act, order, offs, w2, w2, out, d, i, 0, 0, e,
        EP=ep, BM=bm, BN=BLOCK_N, BK=bk, PREC=prec, FP8=False, num_warps=NUM_WARPS, num_stages=stages)
    return out


def experts_sum(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None, shared: int = 0,
                shared_out: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's sum of its K experts' outputs times ``weights`` [T, K], plus the ``shared`` slots' outputs
    and ``shared_out`` -> [T, D]: ``fused_experts`` (same arguments), then ``combine``. Block-FP8 experts at
    prefill sizes on sm90 go through DeepGEMM's grouped GEMMs where it is installed (``engine.moe_deep_gemm``)."""
    if w13_scale is not None and w2_scale is not None:
        n = ids.shape[0] * (ids.shape[1] + shared)
        got = moe_deep_gemm.experts(x, ids, w13, w2, w13_scale, w2_scale, shared) \
            if moe_deep_gemm.usable(x, n, w13) else None
        if got is not None:
            return combine(got[0], weights, row_of=got[1], shared=shared_out, slots=shared)
    per_token = fused_experts(x, ids, w13, w2, w13_scale, w2_scale, shared=shared)
    return combine(per_token, weights, shared=shared_out, slots=shared)


def tma_form(x: torch.Tensor, n: int, e: int, d: int, i: int) -> bool:
    """Whether the FP8 experts take their TMA-fed form: prefill sizes, Hopper or later, rows TMA can address."""
    return (HAS_TMA and n >= FP8_TMA_MIN_ROWS * e and d % 16 == 0 and i % 16 == 0
            and _has_tma(x.device.index or 0))


@functools.cache
def _has_tma(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _fp8_experts_tma(xq: torch.Tensor, xs: torch.Tensor, src: torch.Tensor, order: torch.Tensor,
                     offs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
                     w2_scale: torch.Tensor, out: torch.Tensor) -> None:
    """The FP8 experts' prefill form (see FP8_TMA_MIN_ROWS): the quantized tokens ``xq`` / ``xs`` through the
    TMA-fed gate-up and down kernels, writing ``out`` [T, K, D]."""
    e, two_i, d = w13.shape
    i, n, g = two_i // 2, src.numel(), FP8_GROUP
    ep = triton.next_power_of_2(e)
    sbi, nkd, nki = -(-i // g), -(-d // g), -(-i // g)
    gbm, gwarps, gstages, dbm, dbn, dwarps, dstages = FP8_TMA_TILES
    act = torch.empty(n, i, dtype=FP8_DTYPE, device=xq.device)
    act_s = torch.empty(n, nki, dtype=torch.float32, device=xq.device)
    _moe_gate_up_tma[(nki, row_tiles(n, e, gbm))](
        xq, xs, src, offs, TensorDescriptor.from_tensor(w13.view(e * two_i, d), [g, g]), w13_scale, act, act_s,
        xq.stride(0), d, i, nkd, sbi, e,
        EP=ep, BM=gbm, BK=g, IMPRECISE=g if FP8_TMA_PROMOTE else None, num_warps=gwarps, num_stages=gstages)
    _moe_down_tma[(triton.cdiv(d, dbn), row_tiles(n, e, dbm))](
        TensorDescriptor.from_tensor(act, [dbm, g]), act_s, order, offs,
        TensorDescriptor.from_tensor(w2.view(e * d, i), [dbn, g]), w2_scale, out, d, i, nki, nkd, e,
        EP=ep, BM=dbm, BN=dbn, BK=g, num_warps=dwarps, num_stages=dstages)


def _auto_block_m(n: int, e: int) -> int:
    return min(64, max(16, triton.next_power_of_2(-(-n // e))))


def row_tiles(n: int, e: int, bm: int) -> int:
    """Programs along the rows for ``n`` rows over ``e`` experts in tiles of ``bm``: at least every expert's
    tiles (sum of cdiv(rows_e, bm) < n / bm + min(e, n)), from shapes only (capturable in a CUDA graph)."""
    return triton.cdiv(n, bm) + min(e, n)


def fp8_tiles(n: int, e: int) -> tuple[int, int, int, int, int]:
    """FP8 experts' tiles for ``n`` (token, choice) rows over ``e`` experts: (rows per tile, gate-up warps,
    stages, down kernel's columns per tile, down warps); the FP8_* globals override the table."""
    bm, warps, stages, down_bn, down_warps = next(tiles for upto, tiles in FP8_TILES if n / e <= upto)
    return (FP8_BLOCK_M or bm, FP8_WARPS or warps, FP8_STAGES or stages, FP8_DOWN_BN or down_bn,
            FP8_DOWN_WARPS or down_warps)


def usable(x: torch.Tensor) -> bool:
    """Whether ``combine`` and ``silu_mul`` serve this tensor (CUDA and Triton)."""
    return HAS_TRITON and x.is_cuda


def combine(y: torch.Tensor, weights: torch.Tensor, row_of: torch.Tensor | None = None,
            shared: torch.Tensor | None = None, slots: int = 0) -> torch.Tensor:
    """Each token's weighted sum of its K expert outputs, plus ``shared`` -> [T, D] in y's dtype.

    ``weights`` [T, K] (any float dtype; used in fp32). ``y`` [N, D] holds the expert outputs in (token,
    choice) order ([T, K, D] or [T*K, D]; with ``slots``, [T, K + slots, D]: each token's last ``slots``
    outputs, the shared experts' of ``fused_experts(shared=...)``, added with weight 1), or anywhere with
    ``row_of`` [T * (K + slots)] int: row ``row_of[t * (K + slots) + j]`` of y is token t's output j (-1: a
    skipped choice, counted as 0). ``shared`` [T, D] (contiguous) is added before the one rounding."""
    t, k = weights.shape
    d = y.shape[-1]
    y = y.reshape(-1, d)
    rows_ok = y.shape[0] >= t * (k + slots) if row_of is None else row_of.numel() == t * (k + slots)
    if (y.stride(-1) != 1 or y.stride(0) != d or not rows_ok
            or not (shared is None or shared.is_contiguous())):
        raise ValueError(f"combine: y {tuple(y.shape)}, weights {tuple(weights.shape)}")
    out = torch.empty(t, d, dtype=y.dtype, device=y.device)
    if t == 0:
        return out
    bd = min(1024, triton.next_power_of_2(d))
    wt = weights.contiguous() if k else out  # (no choices besides the slots: never read)
    _moe_combine[(t, triton.cdiv(d, bd))](
        y, row_of if row_of is not None else wt, wt, shared if shared is not None else out, out, d,
        K=k, BD=bd, HAS_ROW=row_of is not None, HAS_SHARED=shared is not None, SLOTS=slots, num_warps=4)
    return out


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """[N, 2I] (gate columns, then up) -> silu(gate) * up [N, I], in fp32 math, rounded once."""
    n, two_i = h.shape
    inter = two_i // 2
    if not h.is_contiguous():
        raise ValueError("silu_mul needs a contiguous [N, 2I] input")
    out = torch.empty(n, inter, dtype=h.dtype, device=h.device)
    if n:
        _silu_mul[(triton.cdiv(n * inter, 2048),)](h, out, n * inter, inter, BLOCK=2048, num_warps=4)
    return out


def fused_experts_reference_fp8(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                               w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                               product_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What the block-FP8 ``fused_experts`` computes, in fp32 torch (for tests): the tokens quantized per 128-channel
    group, each (token, choice)'s gate-up product with its expert's dequantized weights, ``silu(gate) * up``
    quantized per group as the gate-up kernel writes it, and the down product -> [T, K, D] fp32; a skipped
    choice's slot (id ``>= E``) is 0. ``product_dtype``: the gate-up product rounded to it before silu
    (``engine.moe_deep_gemm`` writes it in bf16)."""
    from engine.fp8 import dequantize_blocks
    from engine.fp8_kernels import reference_groups

    t, k = ids.shape
    i = w13.shape[1] // 2
    xq = reference_groups(x)
    out = torch.zeros(t * k, x.shape[1], dtype=torch.float32, device=x.device)
    flat = ids.flatten()
    for e in flat.unique().tolist():
        if e >= w13.shape[0]:
            continue
        rows = (flat == e).nonzero().squeeze(1)
        w = torch.cat([dequantize_blocks(h, s) for h, s in zip(w13[e].chunk(2), w13_scale[e].chunk(2))])
        h = (xq[rows // k] @ w.T).to(product_dtype).float()
        act = torch.nn.functional.silu(h[:, :i]) * h[:, i:]
        out[rows] = reference_groups(act) @ dequantize_blocks(w2[e], w2_scale[e]).T
    return out.view(t, k, -1)


def fused_experts_reference(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The same result by a loop over (token, choice) in fp32 (for tests); a skipped choice's slot is 0."""
    t, k = ids.shape
    i = w13.shape[1] // 2
    out = torch.zeros(t, k, x.shape[1], dtype=torch.float32, device=x.device)
    xf = x.float()
    for r in range(t):
        for c in range(k):
            if int(ids[r, c]) >= w13.shape[0]:
                continue
            w = w13[int(ids[r, c])].float()
            gate, up = w[:i] @ xf[r], w[i:] @ xf[r]
            h = (torch.nn.functional.silu(gate) * up).to(x.dtype).float()
            out[r, c] = w2[int(ids[r, c])].float() @ h
    return out
