"""The router's choice of experts from its logits, in one kernel on CUDA: scores (softmax or sigmoid), the
group limit (``group_limited_greedy``: groups by their best score; ``noaux_tc``: by the sum of their best two
biased scores), the top-k, the weights' normalization and scale (``layers.Router`` says what each means).

Done with torch's ops this is 4 launches a layer for V2's greedy softmax and ~14 for V3's ``noaux_tc``, each a
kernel of a few microseconds that the GPU runs one after another; in one kernel a decode step is 1.01-1.04x faster
on an H100 (docs/benchmarks.md, fourteenth session). One program a token: its E <= 256 logits fit one block. Ties go
to the lower expert index (torch's topk leaves their order unspecified); NaN ranks above every number, as in torch's
topk, and every token gets K distinct ids in [0, E) whatever its logits. Off CUDA (and without Triton)
``layers.Router`` keeps torch's ops; tests/gpu/test_expert_choice.py runs this under Triton's interpreter against
them.
"""

# ruff: noqa: ANN001  (Triton kernel arguments are pointers and ints, typed by the JIT)
from __future__ import annotations

import torch

from engine.fp8_kernels import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}
MAX_EXPERTS = 256  # one block a token

if HAS_TRITON:

    @triton.jit
    def _top1(x, avail, offs, NONE: tl.constexpr):
        """The lowest index among ``avail`` lanes of ``x``'s largest value, NaN above every number (as torch's
        topk has it); (its value there, that index)."""
        key = tl.where(avail, tl.where(x != x, float("inf"), x), float("-inf"))
        at = tl.min(tl.where(avail & (key == tl.max(key, axis=0)), offs, NONE), axis=0)
        return tl.sum(tl.where(offs == at, x, 0.0), axis=0), at

    @triton.jit
    def _expert_choice(LOGITS, BIAS, WEIGHTS, IDS, s_l, E, scale, BLOCK: tl.constexpr, K: tl.constexpr,
                       KB: tl.constexpr, SIGMOID: tl.constexpr, METHOD: tl.constexpr, NG: tl.constexpr,
                       GROUPS: tl.constexpr, PG: tl.constexpr, TOPK_GROUP: tl.constexpr, NORM: tl.constexpr):
        t = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        valid = offs < E
        logits = tl.load(LOGITS + t * s_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
        if SIGMOID:
            scores = tl.sigmoid(logits)
        else:
            ex = tl.exp(logits - tl.max(logits, axis=0))
            scores = ex / tl.sum(ex, axis=0)
        scores = tl.where(valid, scores, float("-inf"))
        if METHOD == 2:
            choice = scores + tl.load(BIAS + offs, mask=valid, other=0.0).to(tl.float32)
        else:
            choice = scores
        if METHOD != 0:
            # each group's score, then the TOPK_GROUP best groups; experts outside them are not chosen
            group = offs // PG
            goffs = tl.arange(0, NG)
            gscore = tl.full([NG], float("-inf"), tl.float32)
            for g in tl.static_range(GROUPS):
                mine = valid & (group == g)
                best, at = _top1(choice, mine, offs, BLOCK)
                if METHOD == 2 and PG > 1:
                    second, _ = _top1(choice, mine & (offs != at), offs, BLOCK)
                    best = best + second
                gscore = tl.where(goffs == g, best, gscore)
            keep = offs < 0
            free = goffs < GROUPS
            for _ in tl.static_range(TOPK_GROUP):
                _, g = _top1(gscore, free, goffs, NG)
                free = free & (goffs != g)
                keep = keep | (group == g)
            # V2 zeroes the other groups' scores (they can still fill the top-k after every kept one), V3 drops them
            if METHOD == 1:
                choice = tl.where(keep | ~valid, choice, 0.0)
            else:
                choice = tl.where(keep, choice, float("-inf"))
        ks = tl.arange(0, KB)
        ids = tl.zeros([KB], tl.int64)
        weights = tl.zeros([KB], tl.float32)
        free = valid
        for k in tl.static_range(K):
            c, at = _top1(choice, free, offs, BLOCK)  # every id in [0, E) and taken once
            w = tl.sum(tl.where(offs == at, scores, 0.0), axis=0)
            if METHOD == 1:
                w = c  # the kept, possibly zeroed, score
            ids = tl.where(ks == k, at.to(tl.int64), ids)
            weights = tl.where(ks == k, w, weights)
            free = free & (offs != at)
        if NORM:
            weights = weights / (tl.sum(weights, axis=0) + 1e-20)
        tl.store(WEIGHTS + t * K + ks, weights * scale, mask=ks < K)
        tl.store(IDS + t * K + ks, ids, mask=ks < K)


def usable(logits: torch.Tensor, method: str) -> bool:
    """Whether the kernel takes these [T, E] fp32 logits: CUDA with Triton, E up to ``MAX_EXPERTS``."""
    return (HAS_TRITON and logits.is_cuda and method in METHODS and logits.shape[-1] <= MAX_EXPERTS
            and logits.dtype == torch.float32 and logits.stride(-1) == 1)


def choose(logits: torch.Tensor, k: int, *, sigmoid: bool, method: str, n_group: int = 1, topk_group: int = 1,
           bias: torch.Tensor | None = None, norm: bool = False,
           scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64), as ``layers.Router`` computes them
    from the same logits (``norm``: the weights divided by their sum, only where k > 1; ``scale``: then times it)."""
    t, e = logits.shape
    if method == "noaux_tc" and bias is None:
        raise ValueError("noaux_tc needs the router's e_score_correction_bias")
    weights = torch.empty(t, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    ng = n_group if method != "greedy" else 1
    _expert_choice[(t,)](
        logits, bias if bias is not None else logits, weights, ids, logits.stride(0), e, float(scale),
        BLOCK=triton.next_power_of_2(e), K=k, KB=triton.next_power_of_2(k), SIGMOID=sigmoid, METHOD=METHODS[method],
        NG=triton.next_power_of_2(ng), GROUPS=ng, PG=e // ng, TOPK_GROUP=topk_group if method != "greedy" else 1,
        NORM=norm and k > 1)
    return weights, ids
