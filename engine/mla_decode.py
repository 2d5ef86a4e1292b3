"""Fused MLA decode attention on the paged latent cache (Triton): absorbed form, split-KV.

Computes, per decode row b and head h, over the row's ``t < seq_lens[b]`` cached tokens::

    s_t   = scale * ([q_lat | q_pe][b, h] . [kv_c | k_pe]_t)       # MQA: every head reads the same latents
    out   = sum_t softmax(s)_t * kv_c_t                             # [B, H, L]
    lse   = log sum_t exp(s_t)                                      # [B, H], natural log; -inf if seq_len 0

A row with ``seq_len`` 0 (a graph's padding) gets zeros and lse -inf, never NaN.

Grid. Stage 1 runs programs (head group, split, b): a program holds ``BLOCK_H`` heads' queries and walks
its split of the row's context in tiles of ``BN`` tokens (``_tiles``), gathered through the block table; each
tile [BN, L+R] is loaded once for all its heads and used twice on the tensor cores (``tl.dot``): the
scores [BLOCK_H, L+R] x [L+R, BN] and the output [BLOCK_H, BN] x [BN, L]; softmax is
online, in fp32. A row's context is cut into ``num_splits`` equal chunks (multiples of BN) from its
own seq_len on the device; with one split stage 1 writes the result, otherwise it writes partial outputs
and LSEs to a workspace and stage 2 (programs (b, h, chunk of latent columns)) merges the splits by LSE.

Rows of one request (a short prefill's rows, replayed from the same graphs as decode steps) read the
same context: with ``grouped`` flags a second launch serves each flagged group of G consecutive rows
with programs of G rows x BH heads (64 queries), each tile loaded once for all of them and masked per
row (causal: row i sees up to its own position); the first launch skips those rows and the merge
combines both launches' splits. One prefill row alone would read its whole context for 16 queries.

Capturable in a CUDA graph: ``num_splits`` and the grid depend only on shapes (batch size, heads, the
block table's width) and the SM count, never on device values; ``seq_lens`` and ``block_tables`` are only
read by the kernels (loops run to each row's length; splits beyond it do nothing); the workspace can be
allocated once (``workspace_for``) and owned by the graph; nothing synchronises with the host.
Triton is optional: without it this module imports, and ``mla_decode`` raises.
"""

# ruff: noqa: ANN001  (Triton kernel arguments are pointers and ints, typed by the JIT, not annotations)
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

from engine import mla_decode_flashmla
from engine.forward_batch import StepMemo
from engine.kv_format import KERNEL_CODE, KVFormat

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs: the engine keeps its torch path
    HAS_TRITON = False

# Tuning knobs (benchmarks/mla_decode.py overrides them). None: chosen from the head count (_config).
BLOCK_H: int | None = None  # heads per program (>= 16: tl.dot's M); each cache tile is loaded once for them
BLOCK_N: int | None = None  # tokens per tile (None: _tiles' choice)
MIN_SPLIT_TOKENS = 64  # a split of the longest possible context covers at least this many tokens
MAX_SPLITS = 128
WAVE: int | None = None  # programs an SM the splits aim at (None: 2 with 16 heads a program, else 1)
# A cap on the decode launch's registers a thread (Triton's ``maxnreg``; None: the compiler's choice, which at 16
# heads leaves room for 2 programs an SM); a lower cap trades spills for occupancy (scripts/mla_decode_ir.py
# --maxnreg counts them); a knob for the sweep.
MAXNREG: int | None = None
NUM_WARPS: int | None = None
NUM_STAGES: int | None = None
# The grouped launch (one request's rows, G of them a program: G x heads = 64 queries a tile).
GROUP_ROWS: int | None = None  # rows a program, a power of two (None: enough for 64 queries, group_rows)
GROUP_BLOCK_N = 64  # the grouped launch's tuning: an H200 sweep, 200 rows over 2k and 8k cached tokens
GROUP_NUM_WARPS = 8
GROUP_NUM_STAGES = 2
# The fp8 format's dots (16-bit queries): "dequant" (tiles times the scale, in q's dtype) or "fp16" (tiles
# converted as stored, the scale applied to scores and output: 4% faster on an H200, docs/benchmarks.md);
# benchmarks/mla_decode.py --fp8-dots compares them.
FP8_DOTS = "fp16"
FP8_DOTS_CODE = {"dequant": 0, "fp16": 1}
# How e4m3 rows become fp16 (the kernel's _e4m3_tile): "ptx" (one instruction a pair, 16-bit layout changes),
# "bits" (the same by integer ops: what Triton's interpreter can run) or "compiler" (Triton's own conversion,
# whose 8-bit layout changes go byte by byte); None: "ptx", "bits" when interpreted.
FP8_CONVERT: str | None = None
FP8_CONVERT_CODE = {"compiler": 0, "bits": 1, "ptx": 2}
# With the "ptx" conversion, pass each converted tile through an opaque 16-bit identity before the dots: Triton
# traces a dot operand back to its loads and, finding 8-bit ones, gives the dot kWidth 4 (operands read by plain
# ld.shared, the tile stored twice: the shared-memory bound Nsight Compute showed); behind the identity the
# operand is a 16-bit value as a bf16 row's is (kWidth 2, ldmatrix). scripts/mla_decode_ir.py shows both.
OPAQUE_TILES = True


def _config(num_heads: int) -> tuple[int, int, int]:
    """(heads per program, warps, pipeline stages) for 16-bit rows, from an H200 sweep (benchmarks/mla_decode.py)."""
    bh = BLOCK_H or min(64, max(16, 1 << (num_heads - 1).bit_length()))
    return bh, NUM_WARPS or (4 if bh <= 16 else 8), NUM_STAGES or (3 if bh <= 16 else 2)


def _tiles(num_heads: int, eight_bit: bool, max_split_tokens: int, num_splits: int) -> tuple[int, int, int, int]:
    """(heads per program, tokens per tile, warps, stages) of the decode launch with ``num_splits`` splits a row,
    each at most ``max_split_tokens`` long (the block table's width over the splits).

    16-bit rows: 32-token tiles, double-buffered by the pipeline. 8-bit rows (``eight_bit``: read by 16-bit
    queries) in few splits (many rows a launch): 64-token tiles loaded straight into registers (one stage, no
    pipeline), as an H100 sweep chose (docs/benchmarks.md): the pipeline would stage the e4m3 bytes in shared
    memory before the conversion writes the fp16 tile there again, and shared memory, not DRAM, bounds that
    kernel; 64-token tiles also halve each warp's reads of the queries a token. With many splits (a few rows over
    all SMs) a split is short: splits are cut from each row's own length at run time, so a graph's table as wide
    as max_model_len says little, and a split of one 64-token tile overlaps nothing (slower at batch 1); those
    keep the pipelined 32-token tiles, whose second tile's copy overlaps the first's dots."""
    bh, warps, stages = _config(num_heads)
    if eight_bit and BLOCK_N is None and NUM_STAGES is None and num_splits <= 8 and max_split_tokens >= 128:
        return bh, 64, warps, 1
    return bh, BLOCK_N or 32, warps, stages


if HAS_TRITON:

    @triton.jit
    def _tile_blocks(BT, r0, s_bt_b, n0, end, BN: tl.constexpr, PAGE: tl.constexpr):
        """The cache block of each of the tile's BN tokens from n0 (0 past ``end``)."""
        offs_n = n0 + tl.arange(0, BN)
        return tl.load(BT + r0 * s_bt_b + offs_n // PAGE, mask=offs_n < end, other=0).to(tl.int64)

    @triton.jit
    def _load_tile(KV, blk, n0, end, s_kv_blk, s_kv_tok, L: tl.constexpr, R: tl.constexpr, BL: tl.constexpr,
                   BR: tl.constexpr, BN: tl.constexpr, PAGE: tl.constexpr, FMT: tl.constexpr, CVT: tl.constexpr):
        """A tile's rows as stored, zeros past ``end``: (kv_c, k_pe, FMT 2's scales [BN, BL / 128] or unused).
        e4m3 values come as bytes [BN, W] with CVT 0, else as int16 pairs of bytes [BN, W / 2] (_e4m3_tile)."""
        offs_n = n0 + tl.arange(0, BN)
        nmask = offs_n < end
        toks = KV + blk * s_kv_blk + (offs_n % PAGE).to(tl.int64) * s_kv_tok  # [BN] token rows of the cache
        if CVT == 0:
            offs_l = tl.arange(0, BL)
            cmask = nmask[:, None] & (offs_l < L)[None, :]
            if FMT == 2:
                raw_c = tl.load(toks[:, None] + offs_l[None, :], mask=cmask, other=0)  # bytes
            else:
                raw_c = tl.load(toks[:, None] + offs_l[None, :], mask=cmask, other=0.0)
        else:
            hl = tl.arange(0, BL // 2)
            raw_c = tl.load(toks.to(tl.pointer_type(tl.int16))[:, None] + hl[None, :],
                            mask=nmask[:, None] & (hl < L // 2)[None, :], other=0)
        if FMT == 2:  # DeepSeek's byte rows: e4m3 kv_c, a float32 scale per 128 of it, bf16 k_pe
            gi = tl.arange(0, BL // 128)
            raw_sc = tl.load((toks + L).to(tl.pointer_type(tl.float32))[:, None] + gi[None, :],
                             mask=nmask[:, None] & (gi < L // 128)[None, :], other=0.0)
            offs_r = tl.arange(0, BR)
            raw_pe = tl.load((toks + L + 4 * (L // 128)).to(tl.pointer_type(tl.bfloat16))[:, None]
                             + offs_r[None, :], mask=nmask[:, None] & (offs_r < R)[None, :], other=0.0)
        else:
            raw_sc = tl.zeros([BN], tl.float32)  # unused
            if CVT == 0:
                offs_r = tl.arange(0, BR)
                raw_pe = tl.load(toks[:, None] + L + offs_r[None, :], mask=nmask[:, None] & (offs_r < R)[None, :],
                                 other=0.0)
            else:
                hr = tl.arange(0, BR // 2)
                raw_pe = tl.load(toks.to(tl.pointer_type(tl.int16))[:, None] + L // 2 + hr[None, :],
                                 mask=nmask[:, None] & (hr < R // 2)[None, :], other=0)
        return raw_c, raw_pe, raw_sc

    @triton.jit
    def _e4m3_tile(raw, BN: tl.constexpr, W: tl.constexpr, CVT: tl.constexpr):
        """e4m3 values -> fp16 [BN, W]; with CVT 1 times 2^-8 (the split kernel scales kv_scale to match).

        CVT 0: bytes converted by the compiler, which moves the 8-bit values between the dots' layouts byte by
        byte in shared memory (the slowest of the three: docs/benchmarks.md). CVT 1 and 2 take int16 pairs
        of bytes and give fp16 first, so the layout changes move 16-bit values (ldmatrix / stmatrix) as for bf16
        rows: CVT 2 with one ``cvt.rn.f16x2.e4m3x2`` a pair, inline PTX marked impure so that the compiler does
        not move the conversion behind the layout changes (once a value, not once a dot); CVT 1 (Triton's
        interpreter, which runs no PTX) by moving bits: an e4m3 byte's sign, exponent and mantissa in fp16's
        places read as its value times 2^-8 (the biases differ by 8), subnormals included."""
        if CVT == 0:
            if raw.dtype == tl.uint8:
                raw = raw.to(tl.float8e4nv, bitcast=True)
            v = raw.to(tl.float16)
        elif CVT == 1:
            x = raw.to(tl.int32)  # sign-extended; only the low 16 bits of the results are kept
            lo = ((x & 0x80) << 8) | ((x & 0x7F) << 7)
            hi = (x & 0x8000) | ((x >> 1) & 0x3F80)
            v = tl.reshape(tl.join(lo.to(tl.int16), hi.to(tl.int16)), (BN, W)).to(tl.float16, bitcast=True)
        else:
            lo, hi = tl.inline_asm_elementwise(
                "{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }", "=h,=h,h",
                [raw.to(tl.int16, bitcast=True)], dtype=(tl.float16, tl.float16), is_pure=False, pack=1)
            v = tl.reshape(tl.join(lo, hi), (BN, W))
        return v

    @triton.jit
    def _opaque16(v):
        """``v`` (16-bit values) unchanged, through inline PTX the compiler cannot see into (OPAQUE_TILES)."""
        return tl.inline_asm_elementwise("mov.b16 $0, $1;", "=h,h", [v], dtype=v.dtype, is_pure=False, pack=1)

    @triton.jit
    def _decode_tile(raw_c, raw_pe, raw_sc, kv_scale, dt: tl.constexpr, BL: tl.constexpr, BR: tl.constexpr,
                     BN: tl.constexpr, FMT: tl.constexpr, ODT: tl.constexpr, CVT: tl.constexpr,
                     OPQ: tl.constexpr):
        """A stored tile as the dots' operands in ``dt`` (see the split kernel's FMT / ODT); ``kv_scale``: the
        fp8 format's scale, already over _e4m3_tile's gain. OPQ: through _opaque16 (OPAQUE_TILES)."""
        if FMT == 0:
            kv_c = raw_c
            k_pe = raw_pe
        elif FMT == 2:
            grouped = tl.reshape(_e4m3_tile(raw_c, BN, BL, CVT).to(tl.float32), (BN, BL // 128, 128))
            gain = 256.0 if CVT == 1 else 1.0
            kv_c = tl.reshape(grouped * (raw_sc * gain)[:, :, None], (BN, BL)).to(dt)
            k_pe = raw_pe.to(dt)
        elif ODT != 0:  # as stored; the scale goes to the scores and the output
            kv_c = _e4m3_tile(raw_c, BN, BL, CVT)
            k_pe = _e4m3_tile(raw_pe, BN, BR, CVT)
        else:
            kv_c = (_e4m3_tile(raw_c, BN, BL, CVT).to(tl.float32) * kv_scale).to(dt)
            k_pe = (_e4m3_tile(raw_pe, BN, BR, CVT).to(tl.float32) * kv_scale).to(dt)
        if OPQ:
            kv_c = _opaque16(kv_c)
            k_pe = _opaque16(k_pe)
        return kv_c, k_pe

    @triton.jit
    def _mla_decode_split(
        QL, QP, KV, BT, LENS, GROUPED, OUT, LSE, POUT, PLSE,
        scale_log2, kv_scale, H,
        s_ql_b, s_ql_h, s_qp_b, s_qp_h, s_kv_blk, s_kv_tok, s_bt_b, s_lens, s_o_b, s_o_h, s_lse_b, s_lse_h,
        L: tl.constexpr, R: tl.constexpr, BL: tl.constexpr, BR: tl.constexpr, PAGE: tl.constexpr,
        BH: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr, WS: tl.constexpr, HAS_LSE: tl.constexpr,
        PREC: tl.constexpr, G: tl.constexpr, MODE: tl.constexpr, FMT: tl.constexpr,
        ODT: tl.constexpr, CVT: tl.constexpr, OPQ: tl.constexpr,
    ):
        # Program (head group, split, group of G rows): its G * BH queries are rows r0..r0+G-1 x BH heads.
        # MODE 0: every row (G = 1); 1: the rows GROUPED does not flag (G = 1); 2: the groups it flags,
        # whose G rows share one block table (one request's prefill rows): each tile serves all of them.
        # Head groups vary fastest: the programs reading one (row, split) run together and share L2.
        split = tl.program_id(1)
        r0 = tl.program_id(2) * G
        qi = tl.arange(0, G * BH)
        rows = r0 + qi // BH  # [G*BH]
        heads = tl.program_id(0) * BH + qi % BH
        hmask = heads < H
        flag = 0  # MODE 0: every program
        if MODE != 0:
            flag = tl.load(GROUPED + r0)
        # a per-query vector, not a scalar (Triton's interpreter refuses scalar masks in vector ones)
        active = (tl.zeros([G * BH], tl.int32) + flag) == 0
        if MODE == 2:
            active = ~active
        if MODE == 0:
            active = rows >= 0
        offs_l = tl.arange(0, BL)
        offs_r = tl.arange(0, BR)
        lmask = offs_l < L
        lens = tl.load(LENS + rows * s_lens).to(tl.int32)  # [G*BH]: each query's context, itself included
        seq_len = tl.max(tl.where(active, lens, 0), 0)
        chunk = tl.cdiv(tl.cdiv(seq_len, SPLITS), BN) * BN
        start = split * chunk
        end = tl.minimum(start + chunk, seq_len)  # empty (no iterations) for splits past the rows' end

        ql_ptr = QL + rows[:, None].to(tl.int64) * s_ql_b + heads[:, None] * s_ql_h
        qp_ptr = QP + rows[:, None].to(tl.int64) * s_qp_b + heads[:, None] * s_qp_h
        # FMT (engine.kv_format): 0 rows in the compute dtype; 1 e4m3 rows times kv_scale; 2 DeepSeek's byte
        # rows (e4m3 kv_c, a float32 scale per 128 of it, bf16 k_pe). Tiles are dequantised to q's dtype,
        # except FMT 1 with ODT set (16-bit queries): its tiles are converted as stored to fp16 (one
        # conversion an element, no multiply), q is brought to fp16 (scaled per query row, ``qs``, only
        # past fp16's range), and kv_scale is applied to the scores and the output instead.
        # CVT (_e4m3_tile): how e4m3 values become fp16; CVT 1's tiles hold them times 2^-8, made up here.
        if CVT == 1:
            kv_scale = kv_scale * 256.0
        dt = KV.dtype.element_ty if FMT == 0 else QL.dtype.element_ty
        if ODT != 0:
            dt = tl.float16
        qmask = hmask & active  # a skipped program reads nothing
        q_lat = tl.load(ql_ptr + offs_l[None, :], mask=qmask[:, None] & lmask[None, :], other=0.0)  # [GBH, BL]
        q_pe = tl.load(qp_ptr + offs_r[None, :], mask=qmask[:, None] & (offs_r < R)[None, :], other=0.0)
        s_row = tl.full([G * BH], 1.0, tl.float32) * scale_log2  # each query's score factor
        o_scale = 1.0
        if ODT != 0:
            amax = tl.maximum(tl.max(tl.abs(q_lat.to(tl.float32)), 1), tl.max(tl.abs(q_pe.to(tl.float32)), 1))
            qs = tl.maximum(amax / 16384.0, 1.0)  # a row beyond fp16's range is scaled to 2^14
            q_lat = q_lat.to(tl.float32) / qs[:, None]
            q_pe = q_pe.to(tl.float32) / qs[:, None]
            s_row = s_row * qs * kv_scale
            o_scale = kv_scale
        q_lat = q_lat.to(dt)
        q_pe = q_pe.to(dt)

        m_i = tl.full([G * BH], float("-inf"), tl.float32)  # running max, log2 units
        l_i = tl.zeros([G * BH], tl.float32)  # running sum of exp2(s - m_i)
        acc = tl.zeros([G * BH, BL], tl.float32)  # running sum of p * kv_c
        # The tile's cache blocks are read one iteration ahead and carried: a tile whose address came from a load
        # in the same iteration is single-buffered by Triton's pipeliner (its copy waited for as soon as issued);
        # carried, the tiles are double-buffered and the next one's copy overlaps this one's dots.
        blk_next = _tile_blocks(BT, r0, s_bt_b, start, end, BN, PAGE)
        for n0 in range(start, end, BN):
            blk = blk_next
            blk_next = _tile_blocks(BT, r0, s_bt_b, n0 + BN, end, BN, PAGE)
            raw_c, raw_pe, raw_sc = _load_tile(KV, blk, n0, end, s_kv_blk, s_kv_tok, L, R, BL, BR, BN, PAGE, FMT, CVT)
            kv_c, k_pe = _decode_tile(raw_c, raw_pe, raw_sc, kv_scale, dt, BL, BR, BN, FMT, ODT, CVT, OPQ)
            offs_n = n0 + tl.arange(0, BN)  # [BN] token positions in the rows' context
            s = tl.dot(q_lat, tl.trans(kv_c), input_precision=PREC)  # [GBH, BN] fp32
            s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=PREC)
            s = tl.where(offs_n[None, :] < lens[:, None], s * s_row[:, None], float("-inf"))  # causal per row
            m_new = tl.maximum(m_i, tl.max(s, 1))  # -inf only for a query none of whose keys came yet
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(s - m_ref[:, None])  # [GBH, BN]
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(dt), kv_c, acc=acc * alpha[:, None], input_precision=PREC)  # [GBH, BL]
            m_i = m_new

        has = l_i > 0.0  # false for an empty split (or a seq_len-0 row)
        o = acc * (o_scale / tl.where(has, l_i, 1.0))[:, None]
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        smask = hmask & active
        if SPLITS == 1:
            o_ptr = OUT + rows[:, None].to(tl.int64) * s_o_b + heads[:, None] * s_o_h + offs_l[None, :]
            tl.store(o_ptr, o.to(OUT.dtype.element_ty), mask=smask[:, None] & lmask[None, :])
            if HAS_LSE:
                tl.store(LSE + rows * s_lse_b + heads * s_lse_h, lse, mask=smask)
        else:
            # workspace: POUT [B, H, WS, L], PLSE [B, H, WS] (fp32, contiguous; this launch's splits are the
            # first SPLITS of WS); empty splits write only their -inf, and the merge never reads their outputs.
            ws_row = (rows.to(tl.int64) * H + heads) * WS + split  # [GBH]
            po_ptr = POUT + ws_row[:, None] * L + offs_l[None, :]
            tl.store(po_ptr, o, mask=(smask & has)[:, None] & lmask[None, :])
            tl.store(PLSE + ws_row, lse, mask=smask)

    @triton.jit
    def _mla_decode_merge(
        POUT, PLSE, GROUPED, OUT, LSE, H, s_o_b, s_o_h, s_lse_b, s_lse_h,
        L: tl.constexpr, LC: tl.constexpr, SPLITS: tl.constexpr, GSPLITS: tl.constexpr, WS: tl.constexpr,
        BS: tl.constexpr, HAS_LSE: tl.constexpr, HAS_GROUPS: tl.constexpr,
    ):
        # program (b, h, chunk of LC latent columns): all splits' partials loaded at once, [BS, LC]; a row
        # the grouped launch served has GSPLITS of them, any other SPLITS
        b = tl.program_id(0)
        h = tl.program_id(1)
        c = tl.program_id(2)
        nsplit = SPLITS
        if HAS_GROUPS:
            nsplit = tl.where(tl.load(GROUPED + b) != 0, GSPLITS, SPLITS)
        # nsplit 1: that launch wrote the row's output itself; nothing to merge
        rows = (b * H + h).to(tl.int64) * WS + tl.arange(0, BS)  # [BS]
        smask = tl.arange(0, BS) < tl.where(nsplit > 1, nsplit, 0)  # vector masks: see the split kernel
        offs_l = c * LC + tl.arange(0, LC)
        lmask = offs_l < L
        lses = tl.load(PLSE + rows, mask=smask, other=float("-inf"))  # [BS]
        m = tl.max(lses, 0)
        m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: every weight exp(-inf) = 0
        w = tl.exp(lses - m)
        total = tl.sum(w, 0)
        live = smask & (lses > float("-inf"))  # an empty split's outputs are never written: never read them
        part = tl.load(POUT + rows[:, None] * L + offs_l[None, :], mask=live[:, None] & lmask[None, :], other=0.0)
        has = total > 0.0
        o = tl.sum(w[:, None] * part, 0) / tl.where(has, total, 1.0)  # [LC]
        merged = offs_l < tl.where(nsplit > 1, L, 0)  # lmask, where this row has splits to merge
        tl.store(OUT + b * s_o_b + h * s_o_h + offs_l, o.to(OUT.dtype.element_ty), mask=merged)
        if HAS_LSE:
            if c == 0:
                lse = tl.where(has, m + tl.log(tl.where(has, total, 1.0)), float("-inf"))
                tl.store(LSE + b * s_lse_b + h * s_lse_h, lse, mask=nsplit > 1)


@dataclass
class MLADecodeWorkspace:
    """Flat fp32 buffers for the split partials; any workspace at least as large as needed serves."""

    part_out: torch.Tensor  # [>= B * H * splits * L]
    part_lse: torch.Tensor  # [>= B * H * splits]


@functools.cache
def _sm_count(device_index: int) -> int:  # asked once: decode calls this in every layer of every step
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def choose_num_splits(batch: int, num_heads: int, max_context: int, device: torch.device) -> int:
    """Splits per row from static quantities only: about one wave of programs (2 per SM with 16 heads a
    program, 1 with more: their tiles fill shared memory), each split of the longest possible context
    (``max_context``, e.g. block-table width x block size) at least MIN_SPLIT_TOKENS long. A power of two,
    so few kernel variants are compiled."""
    bh = _config(num_heads)[0]
    per_sm = WAVE or (2 if bh <= 16 else 1)
    return _wave_splits(max(batch, 1) * math.ceil(num_heads / bh), per_sm, max_context, device)


def _wave_splits(programs: int, per_sm: int, max_context: int, device: torch.device) -> int:
    """Splits so that ``programs`` per split make about one wave (``per_sm`` programs an SM), each split of
    ``max_context`` at least MIN_SPLIT_TOKENS long; a power of two."""
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 8
    want = math.ceil(per_sm * sms / max(programs, 1))
    return _pow2_floor(min(want, max(max_context // MIN_SPLIT_TOKENS, 1), MAX_SPLITS))


def workspace_for(
    batch: int, num_heads: int, kv_lora_rank: int, num_splits: int, device: torch.device | str
) -> MLADecodeWorkspace:
    n = batch * num_heads * num_splits
    return MLADecodeWorkspace(
        torch.empty(n * kv_lora_rank, dtype=torch.float32, device=device),
        torch.empty(n, dtype=torch.float32, device=device),
    )


def group_rows(num_heads: int) -> int:
    """Rows of one request a grouped program serves together: enough for a 64-query tile (1 at 64+ heads)."""
    return GROUP_ROWS or max(1, 64 // max(16, 1 << (num_heads - 1).bit_length()))


def grouped_splits(batch: int, num_heads: int, max_context: int, device: torch.device) -> int:
    """Splits of the grouped launch: about one wave of programs over the ``batch // G`` groups."""
    programs = batch // group_rows(num_heads) * math.ceil(num_heads / _config(num_heads)[0])
    return _wave_splits(programs, 1, max_context, device)


def mla_decode(
    q_lat: torch.Tensor,  # [B, H, L] (q_nope absorbed through W_UK)
    q_pe: torch.Tensor,  # [B, H, R] (rotated)
    kv_cache: torch.Tensor,  # [num_blocks, block_size, row width]: rows of ``kv_format``
    block_tables: torch.Tensor,  # [B, W] int, padded with 0
    seq_lens: torch.Tensor,  # [B] int: tokens in the cache per row (0 for padding rows)
    scale: float,
    out: torch.Tensor | None = None,  # [B, H, L], any float dtype; default q_lat's dtype
    lse: torch.Tensor | None = None,  # [B, H] fp32; given, it is written (implies want_lse)
    want_lse: bool = False,
    workspace: MLADecodeWorkspace | None = None,
    num_splits: int | None = None,
    grouped: torch.Tensor | None = None,  # [B] int: rows served in groups (see below), or None
    kv_format: KVFormat | None = None,  # how the cache stores rows; default: kv_c | k_pe in the cache's dtype
    memo: StepMemo | None = None,  # the step's ForwardBatch.decode_memo: what its layers' calls share
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Absorbed MLA decode attention -> (out_lat [B, H, L] in ``out``'s dtype, default q_lat's; lse [B, H]
    fp32 natural log or None). Capturable when ``out``, ``lse`` and ``workspace`` are given.

    ``grouped``: a nonzero flag on rows r..r+G-1 (r a multiple of ``group_rows(H)``, all G flagged or
    none) says those rows share one block table, as one request's prefill rows do: a second launch serves
    each such group with programs of G rows, so each tile of their context is read once for all of them
    (the first launch skips them). The flags are device values: a graph captured with them serves any mix.

    An ``fp8`` cache of 64-token blocks on Hopper goes to FlashMLA's FP8 kernel where it is installed
    (``engine.mla_decode_flashmla``; no lse there, each row served alone).
    """
    if not HAS_TRITON:
        raise RuntimeError("mla_decode needs triton")
    b, h, lat = q_lat.shape
    rope = q_pe.shape[-1]
    nb, page, width = kv_cache.shape
    fmt = KERNEL_CODE[kv_format.name] if kv_format is not None else 0
    if kv_format is not None and (kv_format.lora, kv_format.rope) != (lat, rope):
        raise ValueError(f"kv_format of {kv_format.lora} + {kv_format.rope} for q of {lat} + {rope}")
    if kv_format is not None:
        kv_format.check_cache(kv_cache, "mla_decode")
    if fmt == 0 and width != lat + rope or q_pe.shape[:2] != (b, h) or block_tables.shape[0] != b or \
            seq_lens.shape != (b,):
        raise ValueError(f"shapes: q_lat {tuple(q_lat.shape)}, q_pe {tuple(q_pe.shape)}, cache "
                         f"{tuple(kv_cache.shape)}, tables {tuple(block_tables.shape)}, lens {tuple(seq_lens.shape)}")
    if q_lat.stride(-1) != 1 or q_pe.stride(-1) != 1 or kv_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("the last dimension of q_lat, q_pe, kv_cache and block_tables must be contiguous")
    if mla_decode_flashmla.usable(q_lat, q_pe, kv_cache, kv_format, want_lse or lse is not None):
        assert kv_format is not None
        return mla_decode_flashmla.decode(q_lat, q_pe, kv_cache, block_tables, seq_lens, scale, kv_format, out,
                                          memo), None
    g = group_rows(h)
    if grouped is not None and (g == 1 or b < g or kv_cache.element_size() > 2):
        grouped = None  # nothing to group (a head group fills a tile, or too few rows), or fp32 tiles too large
    if grouped is not None and (grouped.shape != (b,) or grouped.stride(0) != 1):
        raise ValueError(f"grouped must be a contiguous [B] tensor, got {tuple(grouped.shape)}")
    if num_splits is None:
        num_splits = choose_num_splits(b, h, block_tables.shape[1] * page, q_lat.device)
    gsplits = 0
    if grouped is not None:  # split too only where the decode launch does (a merge launch for both)
        gsplits = grouped_splits(b, h, block_tables.shape[1] * page, q_lat.device) if num_splits > 1 else 1
    ws = max(num_splits, gsplits)
    if out is None:
        out = torch.empty(b, h, lat, dtype=q_lat.dtype, device=q_lat.device)
    if lse is None and want_lse:
        lse = torch.empty(b, h, dtype=torch.float32, device=q_lat.device)
    lse_arg = lse if lse is not None else out  # never written when HAS_LSE is false
    lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    merge = ws > 1
    if merge:
        if workspace is None:
            workspace = workspace_for(b, h, lat, ws, q_lat.device)
        n = b * h * ws
        if workspace.part_lse.numel() < n or workspace.part_out.numel() < n * lat:
            raise ValueError(f"workspace too small for batch {b}, {h} heads, {ws} splits")
        pout, plse = workspace.part_out, workspace.part_lse
    else:
        pout, plse = out, out  # unused with one split
    bl, br = max(triton.next_power_of_2(lat), 16), max(triton.next_power_of_2(rope), 16)  # tl.dot: K >= 16
    # fp32 tiles (an fp32 cache, or a quantized one read by fp32 queries): exact fp32 products
    prec = "ieee" if (q_lat.dtype if fmt else kv_cache.dtype) == torch.float32 else "tf32"
    # (8-bit rows read by fp32 queries make fp32 tiles, twice the shared memory: not measured, they keep 32 tokens)
    eight_bit = fmt != 0 and q_lat.element_size() == 2
    bh, bn, warps, stages = _tiles(h, eight_bit, block_tables.shape[1] * page // num_splits, num_splits)
    flags = grouped if grouped is not None else seq_lens  # never read without groups
    args = (q_lat, q_pe, kv_cache, block_tables, seq_lens, flags, out, lse_arg, pout, plse,
            scale * math.log2(math.e), kv_format.scale if kv_format is not None else 1.0, h,
            q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), kv_cache.stride(0), kv_cache.stride(1),
            block_tables.stride(0), seq_lens.stride(0), out.stride(0), out.stride(1), *lse_strides)
    odt = FP8_DOTS_CODE[FP8_DOTS] if fmt == 1 and q_lat.element_size() == 2 else 0
    cvt = FP8_CONVERT_CODE[FP8_CONVERT or ("bits" if os.environ.get("TRITON_INTERPRET") == "1" else "ptx")]
    common = dict(L=lat, R=rope, BL=bl, BR=br, PAGE=page, BH=bh, WS=ws, HAS_LSE=lse is not None, PREC=prec,
                  FMT=fmt, ODT=odt, CVT=cvt if fmt else 0, OPQ=bool(fmt and cvt == 2 and OPAQUE_TILES))
    cap = {"maxnreg": MAXNREG} if MAXNREG else {}
    _mla_decode_split[(triton.cdiv(h, bh), num_splits, b)](
        *args, **common, BN=bn, SPLITS=num_splits, G=1, MODE=0 if grouped is None else 1,
        num_warps=warps, num_stages=stages, **cap)
    if grouped is not None:
        _mla_decode_split[(triton.cdiv(h, bh), gsplits, b // g)](
            *args, **common, BN=GROUP_BLOCK_N, SPLITS=gsplits, G=g, MODE=2, num_warps=GROUP_NUM_WARPS,
            num_stages=GROUP_NUM_STAGES)
    if merge:
        bs = triton.next_power_of_2(ws)
        lc = min(bl, max(32, 8192 // bs))  # a [splits, LC] fp32 tile of at most 8192 values
        _mla_decode_merge[(b, h, triton.cdiv(lat, lc))](
            pout, plse, flags, out, lse_arg, h, out.stride(0), out.stride(1), *lse_strides,
            L=lat, LC=lc, SPLITS=num_splits, GSPLITS=gsplits, WS=ws, BS=bs, HAS_LSE=lse is not None,
            HAS_GROUPS=grouped is not None, num_warps=4,
        )
    return out, lse


def mla_decode_reference(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    want_lse: bool = False,
    workspace: MLADecodeWorkspace | None = None,
    num_splits: int | None = None,
    kv_format: KVFormat | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same in plain torch, fp32, one row at a time (reads seq_lens on the host): the tests' oracle.
    Returns fp32 out_lat [B, H, L] and lse [B, H] (or None); ``workspace``/``num_splits`` are ignored;
    the rows of a ``kv_format`` cache are decoded by that format's own ``decode``."""
    b, h, lat = q_lat.shape
    page = kv_cache.shape[1]
    flat = kv_cache.reshape(-1, kv_cache.shape[-1])
    res = torch.zeros(b, h, lat, dtype=torch.float32, device=q_lat.device)
    lse_ref = torch.full((b, h), float("-inf"), dtype=torch.float32, device=q_lat.device)
    for i, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        pos = torch.arange(n, device=kv_cache.device)
        rows = flat[block_tables[i, pos // page].long() * page + pos % page]
        kv = (rows if kv_format is None else kv_format.decode(rows)).float()  # [n, L+R]
        q = torch.cat((q_lat[i], q_pe[i]), dim=-1).float()  # [H, L+R]
        scores = (q @ kv.T) * scale  # [H, n]
        lse_ref[i] = torch.logsumexp(scores, dim=-1)
        res[i] = torch.softmax(scores, dim=-1) @ kv[:, :lat]
    if out is not None:
        out.copy_(res)
    if lse is not None:
        lse.copy_(lse_ref)
    return (out if out is not None else res), (lse_ref if (want_lse or lse is not None) else None)
