"""Routing for the fused MoE (``engine.moe_kernels``): every (token, choice) placed in expert order without a
sort, from expert ids [T, K] to ``offs`` (each expert's rows), ``src`` (row -> token) and ``order`` (row -> flat
(token, choice) index), in shapes fixed by T, K and E only (capturable in a CUDA graph).

``_moe_route`` is one program walking the rows twice (count, then place); from ``ROUTE_SPLIT_ROWS`` rows three
kernels over chunks of rows do it (``_moe_count`` per chunk, ``_moe_offsets`` one scan, ``_moe_place`` per
chunk). Shared experts that every token chooses (``route(..., shared=S)``) are laid out after the routed rows
(``_moe_shared_rows``), not counted. Choices of ids ``>= E`` get no row (expert parallelism's graphs pass other
ranks' choices so).
"""

# ruff: noqa: ANN001  (Triton kernel arguments are pointers and ints, typed by the JIT, not annotations)
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs: the MoE keeps its torch paths
    HAS_TRITON = False

# From this many (token, choice) rows routing runs as three kernels over chunks of rows (count per chunk,
# offsets, place) instead of one program walking all rows twice; 0: always one program. One MoE layer on
# an H200 (benchmarks/moe.py --route-split-rows 0 / 512): 200 tokens 307 -> 287 us, 512 tokens 393 -> 335.
ROUTE_SPLIT_ROWS = 512
ROUTE_CHUNK = 128

if HAS_TRITON:

    @triton.jit
    def _moe_route(IDS, OFFS, SRC, ORDER, N, S, E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr,
                   CHUNK: tl.constexpr):
        experts = tl.arange(0, EP)
        counts = tl.zeros([EP], tl.int32)
        for c in range(0, tl.cdiv(N, CHUNK)):  # pass 1: rows per expert
            i = c * CHUNK + tl.arange(0, CHUNK)
            e = tl.load(IDS + i, mask=i < N, other=EP).to(tl.int32)
            counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), 0)
        ends = tl.cumsum(counts, 0)
        starts = ends - counts
        tl.store(OFFS + 1 + experts, ends, mask=experts < E)
        tl.store(OFFS + experts, 0, mask=experts == 0)
        _shared_offsets(OFFS, tl.sum(tl.where(experts < E, counts, 0), 0), N // K, S, E)
        seen = tl.zeros([EP], tl.int32)
        for c in range(0, tl.cdiv(N, CHUNK)):  # pass 2: each row's place among its expert's rows, in order
            i = c * CHUNK + tl.arange(0, CHUNK)
            m = i < N
            e = tl.load(IDS + i, mask=m, other=EP).to(tl.int32)
            hot = (e[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, EP]
            before = tl.cumsum(hot, 0) - hot + seen[None, :]  # earlier rows of the same expert
            row = tl.sum(hot * (starts[None, :] + before), 1)
            m = m & (e < EP)  # an id past the one-hot's columns (a skipped choice) has no row
            tl.store(SRC + row, i // K, mask=m)
            tl.store(ORDER + row, i + (i // K) * S, mask=m)  # (token, choice) of K + S choices a token
            seen += tl.sum(hot, 0)

    @triton.jit
    def _shared_offsets(OFFS, routed_rows, T, S, E):
        # the S shared experts after the E routed: every token's row, T rows each
        for j in range(0, S):
            tl.store(OFFS + E + 1 + j, routed_rows + (j + 1) * T)

    @triton.jit
    def _moe_shared_rows(OFFS, SRC, ORDER, T, K: tl.constexpr, S: tl.constexpr, E, BLOCK: tl.constexpr):
        # program (token block, j): shared expert j's rows, one a token in token order, after the routed rows
        j = tl.program_id(1)
        t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = t < T
        row = tl.load(OFFS + E) + j * T + t
        tl.store(SRC + row, t, mask=m)
        tl.store(ORDER + row, t * (K + S) + K + j, mask=m)

    @triton.jit
    def _moe_count(IDS, COUNTS, N, EP: tl.constexpr, CHUNK: tl.constexpr):
        # program p: rows per expert among rows [p * CHUNK, (p + 1) * CHUNK) -> COUNTS[p, :]
        p = tl.program_id(0)
        experts = tl.arange(0, EP)
        i = p * CHUNK + tl.arange(0, CHUNK)
        e = tl.load(IDS + i, mask=i < N, other=EP).to(tl.int32)
        tl.store(COUNTS + p * EP + experts, tl.sum((e[:, None] == experts[None, :]).to(tl.int32), 0))

    @triton.jit
    def _moe_offsets(COUNTS, BASE, OFFS, P, E, T, S, EP: tl.constexpr, CT: tl.constexpr):
        # one program: expert e's rows start at OFFS[e]; chunk p's rows of expert e at BASE[p, e] (earlier chunks'
        # rows of e first). Chunks in tiles of CT ([CT, EP] counts at a time), over a loop bounded at run time:
        # the experts' totals first, then each tile's offsets after the tiles before it. (No shape in a
        # constexpr: one compile serves every step's row count, where a size-dependent tile compiled anew, for
        # seconds, at the first step of each new size.)
        experts = tl.arange(0, EP)
        tile = tl.arange(0, CT)
        totals = tl.zeros([EP], tl.int32)
        for c0 in range(0, P, CT):
            chunks = c0 + tile
            m = (chunks < P)[:, None]
            totals += tl.sum(tl.load(COUNTS + chunks[:, None] * EP + experts[None, :], mask=m, other=0), 0)
        ends = tl.cumsum(totals, 0)
        tl.store(OFFS + 1 + experts, ends, mask=experts < E)
        tl.store(OFFS + experts, ends * 0, mask=experts == 0)  # offs[0] = 0
        _shared_offsets(OFFS, tl.sum(tl.where(experts < E, totals, 0), 0), T, S, E)
        running = ends - totals
        for c0 in range(0, P, CT):
            chunks = c0 + tile
            m = (chunks < P)[:, None]
            counts = tl.load(COUNTS + chunks[:, None] * EP + experts[None, :], mask=m, other=0)  # [CT, EP]
            tl.store(BASE + chunks[:, None] * EP + experts[None, :], running[None, :] + tl.cumsum(counts, 0) - counts,
                     mask=m)
            running += tl.sum(counts, 0)

    @triton.jit
    def _moe_place(IDS, BASE, SRC, ORDER, N, S, K: tl.constexpr, EP: tl.constexpr, CHUNK: tl.constexpr):
        # program p: each of its rows' place among its expert's rows, in row order (as _moe_route)
        p = tl.program_id(0)
        experts = tl.arange(0, EP)
        i = p * CHUNK + tl.arange(0, CHUNK)
        m = i < N
        e = tl.load(IDS + i, mask=m, other=EP).to(tl.int32)
        hot = (e[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, EP]
        base = tl.load(BASE + p * EP + experts)
        row = tl.sum(hot * (base[None, :] + tl.cumsum(hot, 0) - hot), 1)
        m = m & (e < EP)  # a skipped choice (id past the columns) has no row
        tl.store(SRC + row, i // K, mask=m)
        tl.store(ORDER + row, i + (i // K) * S, mask=m)


def route(ids: torch.Tensor, num_experts: int, shared: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert ids [T, K] -> (offs [E+S+1], src [T*(K+S)], order [T*(K+S)]) int32 for E routed experts and
    ``shared`` (S) experts after them that every token chooses too, as its choices K..K+S-1: expert e's rows are
    ``offs[e]:offs[e+1]``, in token order; row r is token ``src[r]``'s choice ``order[r] % (K+S)``. Choices of
    ids ``>= E`` get no row of ``[0, offs[E])``. (The shared rows are laid out, not counted: a one-hot of E + S
    columns would round up to the next power of two, and the offsets' scan grows with its square.)"""
    t, k = ids.shape
    n = t * k
    dev = ids.device
    offs = torch.empty(num_experts + shared + 1, dtype=torch.int32, device=dev)
    src = torch.empty(t * (k + shared), dtype=torch.int32, device=dev)
    order = torch.empty(t * (k + shared), dtype=torch.int32, device=dev)
    ep = triton.next_power_of_2(num_experts)
    flat = ids.reshape(-1)
    if k == 0:  # the shared experts alone (expert parallelism: each rank's own rows)
        offs[: num_experts + 1].zero_()
        torch.mul(torch.arange(1, shared + 1, dtype=torch.int32, device=dev), t, out=offs[num_experts + 1 :])
    elif ROUTE_SPLIT_ROWS and n >= ROUTE_SPLIT_ROWS:
        chunk = max(16, min(ROUTE_CHUNK, 8192 // ep))  # a [chunk, EP] one-hot tile per program
        chunks = triton.cdiv(n, chunk)
        counts = torch.empty(chunks, ep, dtype=torch.int32, device=dev)
        base = torch.empty(chunks, ep, dtype=torch.int32, device=dev)
        _moe_count[(chunks,)](flat, counts, n, EP=ep, CHUNK=chunk, num_warps=4)
        _moe_offsets[(1,)](counts, base, offs, chunks, num_experts, t, shared, EP=ep, CT=max(1, 4096 // ep),
                           num_warps=4)  # [CT, EP] tiles of at most 4,096 counts: their scans fit shared memory
        _moe_place[(chunks,)](flat, base, src, order, n, shared, K=k, EP=ep, CHUNK=chunk, num_warps=4)
    else:
        _moe_route[(1,)](flat, offs, src, order, n, shared, E=num_experts, EP=ep, K=k,
                         CHUNK=max(16, min(256, 8192 // ep)), num_warps=4)
    if shared and t:
        _moe_shared_rows[(triton.cdiv(t, 1024), shared)](offs, src, order, t, K=k, S=shared, E=num_experts,
                                                         BLOCK=1024, num_warps=4)
    return offs, src, order
