"""Block-FP8 routed experts at prefill sizes through DeepGEMM's grouped FP8 GEMMs (Hopper; optional).

Our Triton grouped GEMM runs the FP8 experts at prefill sizes at about bf16 cuBLAS's rate; DeepGEMM's
``m_grouped_fp8_gemm_nt_contiguous`` (PyPI ``sgl-deep-gemm``, the build SGLang ships; its kernels compile at
first use) runs the same products much faster (docs/benchmarks.md). It multiplies rows grouped by expert,
each expert's rows starting at a multiple of its alignment (128 rows), with each row's expert in an int32
index (-1: a padding row; a block of rows that begins with one is skipped). Around its two GEMMs, kernels of
ours do the glue:

1. ``_dg_layout``: from ``engine.moe_routing.route``'s ``offs`` / ``src`` / ``order``, each padded slot's
   expert (or -1) and token, and each (token, choice)'s slot (-1: a skipped choice);
2. ``_dg_gather``: the quantized tokens (e4m3 rows, 1 x 128 scales) copied into their slots, the scales
   MN-major (``[K / 128, M]``), the layout DeepGEMM's sm90 kernels read;
3. DeepGEMM's gate-up -> ``[M, 2I]`` bf16;
4. ``_dg_silu_quant``: silu(gate) * up in fp32, quantized per 128 columns, scales MN-major;
5. DeepGEMM's down -> ``[M, D]`` bf16, which ``moe_kernels.combine`` reads through each (token, choice)'s slot.

``M`` is a bound fixed by the shapes (every expert's rows padded by at most alignment - 1), so nothing is
read back to the host and the path is capturable. It is on where DeepGEMM is installed (the ``deepgemm`` extra;
``PDCLUSTER_DEEP_GEMM=0`` turns it off, ``engine.envs``); its kernels compile with NVCC from ``$CUDA_HOME``
(DeepGEMM's NVRTC mode cannot: its headers include the C++ standard library's), at start-up (``warm_up``).
Without the package, on a GPU other than sm90, or if its kernels fail to compile (logged once), the experts keep
``moe_kernels``' Triton path. DeepGEMM writes the gate-up product in bf16 where the Triton kernels keep it in
fp32 up to the quantization of ``silu(gate) * up``: the two paths differ by ~1.3% of each row (e4m3 roundings
that flip), well under FP8's own error (tests/gpu/test_moe_deep_gemm.py).
"""

# ruff: noqa: ANN001  (Triton kernel arguments are pointers and ints, typed by the JIT, not annotations)
from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from engine import envs
from engine.fp8 import FP8_DTYPE
from engine.fp8_kernels import GROUP, quantize_groups, sm90
from engine.moe_routing import route

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    HAS_TRITON = False

log = logging.getLogger(__name__)

# From this many (token, choice) rows an expert on average (the Triton experts' TMA form starts there too;
# below it the padding to 128 rows an expert costs more than DeepGEMM saves).
MIN_ROWS = 64.0
_state = {"failed": False}

if HAS_TRITON:
    from engine.fp8_kernels import quantize_rows

    @triton.jit
    def _dg_layout(OFFS, SRC, ORDER, MIDX, PSRC, SLOT, M, E, EP: tl.constexpr, ALIGN: tl.constexpr,
                   BLOCK: tl.constexpr):
        # program: BLOCK padded slots. Expert e's rows OFFS[e]:OFFS[e+1] go to slots starting at the sum of the
        # earlier experts' row counts, each rounded up to ALIGN.
        s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        experts = tl.arange(0, EP)
        em = experts < E
        lo = tl.load(OFFS + experts, mask=em, other=0)
        cnt = tl.load(OFFS + 1 + experts, mask=em, other=0) - lo
        padded = (cnt + ALIGN - 1) // ALIGN * ALIGN
        pend = tl.cumsum(padded, 0)
        e = tl.sum((pend[None, :] <= s[:, None]).to(tl.int32), 1)  # past the last expert's slots: >= E
        sel = experts[None, :] == e[:, None]
        rank = s - tl.sum(tl.where(sel, (pend - padded)[None, :], 0), 1)
        valid = (e < E) & (rank < tl.sum(tl.where(sel, cnt[None, :], 0), 1)) & (s < M)
        r = tl.sum(tl.where(sel, lo[None, :], 0), 1) + rank
        sm = s < M
        tl.store(MIDX + s, tl.where(valid, e, -1), mask=sm)
        tl.store(PSRC + s, tl.load(SRC + r, mask=valid, other=0), mask=sm)
        tl.store(SLOT + tl.load(ORDER + r, mask=valid, other=0), s, mask=valid)

    @triton.jit
    def _dg_gather(XQ, XS, PSRC, MIDX, A, SF, M, D, NKD, BR: tl.constexpr, G: tl.constexpr):
        # program (slot block, group): the slots' token rows' e4m3 bytes in one group, and their scales MN-major
        s = tl.program_id(0) * BR + tl.arange(0, BR)
        g = tl.program_id(1)
        valid = tl.load(MIDX + s, mask=s < M, other=-1) >= 0
        tok = tl.load(PSRC + s, mask=valid, other=0).to(tl.int64)
        cols = g * G + tl.arange(0, G)
        m = valid[:, None] & (cols < D)[None, :]
        q = tl.load(XQ + tok[:, None] * D + cols[None, :], mask=m, other=0)
        tl.store(A + s[:, None].to(tl.int64) * D + cols[None, :], q, mask=m)
        tl.store(SF + g * M + s, tl.load(XS + tok * NKD + g, mask=valid, other=0.0), mask=valid)

    @triton.jit
    def _dg_silu_quant(H, MIDX, Q, SF, M, INTER, BR: tl.constexpr, G: tl.constexpr):
        # program (slot block, group): silu(gate) * up over one group of 128 columns, quantized per row
        s = tl.program_id(0) * BR + tl.arange(0, BR)
        g = tl.program_id(1)
        valid = tl.load(MIDX + s, mask=s < M, other=-1) >= 0
        cols = g * G + tl.arange(0, G)
        m = valid[:, None] & (cols < INTER)[None, :]
        row = s[:, None].to(tl.int64) * (2 * INTER)
        gate = tl.load(H + row + cols[None, :], mask=m, other=0.0).to(tl.float32)
        up = tl.load(H + row + INTER + cols[None, :], mask=m, other=0.0).to(tl.float32)
        h, sc = quantize_rows(tl.where(m, gate / (1.0 + tl.exp(-gate)) * up, 0.0))
        tl.store(Q + s[:, None].to(tl.int64) * INTER + cols[None, :], h.to(Q.dtype.element_ty), mask=m)
        tl.store(SF + g * M + s, sc, mask=valid)


@functools.cache
def library() -> Any:
    """DeepGEMM, or None (turned off, not installed, or its module does not load: logged once)."""
    if not envs.deep_gemm():
        return None
    try:
        import deep_gemm
    except Exception as e:  # not installed, or its host module failed to load (CUDA libraries, headers)
        log.info("DeepGEMM not used for the FP8 experts: %s: %s", type(e).__name__, e)
        return None
    return deep_gemm


def usable(x: torch.Tensor, n: int, w13: torch.Tensor) -> bool:
    """Whether ``experts`` serves ``n`` (token, choice) rows of bf16 ``x`` over block-FP8 experts ``w13``
    [E, 2I, D]: prefill sizes on an sm90 GPU with DeepGEMM, channels in whole 128-groups."""
    e, two_i, d = w13.shape
    return (HAS_TRITON and x.is_cuda and x.dtype == torch.bfloat16 and not _state["failed"]
            and n >= MIN_ROWS * e and d % GROUP == 0 and two_i % (2 * GROUP) == 0
            and sm90(x.device.index or 0) and library() is not None)


def experts(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
            w2_scale: torch.Tensor, shared: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``moe_kernels.fused_experts``' block-FP8 experts (same arguments) through DeepGEMM -> (expert outputs
    [M, D], each (token, choice)'s row of them [T * (K + shared)], -1 for a skipped choice), for
    ``moe_kernels.combine(..., row_of=...)``; None if DeepGEMM failed (logged; the caller runs its own)."""
    dg = library()
    t, k = ids.shape
    e, two_i, d = w13.shape
    i, n, dev = two_i // 2, t * (k + shared), x.device
    align = int(dg.get_mk_alignment_for_contiguous_layout())
    m = triton.cdiv(n + e * (align - 1), align) * align  # every expert's rows padded: at most this many slots
    offs, src, order = route(ids, e - shared, shared)
    midx = torch.empty(m, dtype=torch.int32, device=dev)
    psrc = torch.empty(m, dtype=torch.int32, device=dev)
    slot = torch.full((n,), -1, dtype=torch.int32, device=dev)
    ep = triton.next_power_of_2(e)
    block = max(16, min(128, 8192 // ep))
    _dg_layout[(triton.cdiv(m, block),)](offs, src, order, midx, psrc, slot, m, e, EP=ep, ALIGN=align,
                                         BLOCK=block, num_warps=4)
    xq, xs = quantize_groups(x)
    nkd, nki = d // GROUP, i // GROUP
    a = torch.empty(m, d, dtype=FP8_DTYPE, device=dev)
    a_sf = torch.empty(nkd, m, dtype=torch.float32, device=dev)
    br = 32
    _dg_gather[(triton.cdiv(m, br), nkd)](xq.view(torch.uint8), xs, psrc, midx, a.view(torch.uint8), a_sf, m, d,
                                          nkd, BR=br, G=GROUP, num_warps=4)
    del xq, xs
    try:
        # Each buffer allocated when it is needed and the last one's inputs dropped first: at V3's shape and 16k
        # tokens the four at once would take ~5.7 GB.
        h = torch.empty(m, two_i, dtype=torch.bfloat16, device=dev)
        dg.m_grouped_fp8_gemm_nt_contiguous((a, a_sf.t()), (w13, w13_scale), h, midx)
        del a, a_sf
        hq = torch.empty(m, i, dtype=FP8_DTYPE, device=dev)
        h_sf = torch.empty(nki, m, dtype=torch.float32, device=dev)
        _dg_silu_quant[(triton.cdiv(m, br), nki)](h, midx, hq, h_sf, m, i, BR=br, G=GROUP, num_warps=4)
        del h
        y = torch.empty(m, d, dtype=torch.bfloat16, device=dev)
        dg.m_grouped_fp8_gemm_nt_contiguous((hq, h_sf.t()), (w2, w2_scale), y, midx)
    except torch.OutOfMemoryError:  # the step's, not DeepGEMM's: the caller sees it as from any other kernel
        raise
    except RuntimeError as err:  # its kernel's compile (NVCC at $CUDA_HOME) or a check of its inputs
        _state["failed"] = True
        log.warning("DeepGEMM failed; the FP8 experts keep their Triton kernels: %s", str(err)[:500])
        return None
    return y, slot


def doublings(first: int, last: int) -> list[int]:
    """The row counts a warm-up runs so DeepGEMM builds the kernel it picks for each: ``first``, doubled while
    under ``last``, then ``last``."""
    sizes, t = [], first
    while t < last:
        sizes.append(t)
        t *= 2
    return [*sizes, last]


def warm_up(model: torch.nn.Module, max_tokens: int) -> int:
    """Compile DeepGEMM's kernels before serving: the first block-FP8 MoE layer's experts run on zeros at each
    doubling of the token count from the least that takes this path up to ``max_tokens`` (a prefill step's most
    rows), as DeepGEMM picks its kernel by the rows. Without it the first prompts of each size would wait for
    NVCC (seconds a kernel). Returns the sizes run (0 when the path is not taken here)."""
    moe: Any = next((m for m in model.modules() if getattr(m, "w13_scale_inv", None) is not None), None)
    if moe is None or not moe.w13.is_cuda or library() is None or (moe.ep is not None and moe.ep.comm is not None):
        return 0  # (expert parallelism's dispatched experts keep the Triton kernels)
    w13, top, shared = moe.w13, moe.gate.cfg.num_experts_per_tok, moe.shared_slots
    routed = w13.shape[0] - shared
    sizes = doublings(max(1, int(-(-MIN_ROWS * w13.shape[0] // (top + shared)))), max_tokens)
    x = torch.zeros(max_tokens, w13.shape[2], dtype=torch.bfloat16, device=w13.device)
    ids = (torch.arange(max_tokens * top, device=w13.device) % routed).view(max_tokens, top)  # int64, as topk gives
    ran = 0
    for t in sizes:
        if usable(x[:t], t * (top + shared), w13):
            ran += experts(x[:t], ids[:t], w13, moe.w2, moe.w13_scale_inv, moe.w2_scale_inv, shared) is not None
    torch.cuda.synchronize(w13.device)
    torch.cuda.empty_cache()  # its buffers back to the device: the KV cache is allocated next (sized before this)
    return ran
