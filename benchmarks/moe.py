"""Routed experts at decode sizes: the fused Triton MoE (engine/moe_kernels.py) against torch's grouped
GEMM path (sort, gather, two ``torch._grouped_mm``, scatter) on one MoE layer's experts, both replayed
from CUDA graphs; with ``--sweep`` the Triton tile configurations side by side.

  python benchmarks/moe.py                  # V2-Lite's experts (64 x 2048 x 1408, top-6), bf16
  python benchmarks/moe.py --sweep
  python benchmarks/moe.py --tokens 200 512 --route-split-rows 512   # routing over chunks of rows (vs 0)

Reports µs per layer call and the weight-read bandwidth (bytes of the experts used / time). Ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import moe_kernels, moe_routing  # noqa: E402


def grouped(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The engine's previous decode path (engine.layers.MoE with torch._grouped_mm), unweighted [T, K, D]."""
    k = ids.shape[1]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = flat.new_zeros(w13.shape[0]).index_add_(0, flat, torch.ones_like(flat))
    xs = x[order // k]
    offs = torch.cumsum(counts, 0).to(torch.int32)
    gate, up = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    out = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    return torch.empty_like(out).index_copy_(0, order, out).view(x.shape[0], k, -1)


def time_graph(fn, iters: int = 200) -> float:  # noqa: ANN001
    """µs per call of fn() replayed from a CUDA graph (L2 not flushed: layers run back to back anyway)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters // 10):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1408)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--route-split-rows", type=int, default=moe_routing.ROUTE_SPLIT_ROWS,
                    help="moe_routing.ROUTE_SPLIT_ROWS: route over chunks of rows from this many rows (0: never)")
    args = ap.parse_args()
    moe_routing.ROUTE_SPLIT_ROWS = args.route_split_rows
    e, d, i = args.experts, args.hidden, args.inter
    g = torch.Generator(device="cuda").manual_seed(0)
    # several layers' weights, cycled, so a call does not find its weights in L2 from the previous one
    layers = 8
    w13s = [torch.randn(e, 2 * i, d, device="cuda", dtype=torch.bfloat16, generator=g) / d**0.5 for _ in range(layers)]
    w2s = [torch.randn(e, d, i, device="cuda", dtype=torch.bfloat16, generator=g) / i**0.5 for _ in range(layers)]
    expert_bytes = 3 * d * i * 2
    configs = [(moe_kernels.BLOCK_M, moe_kernels.BLOCK_N, moe_kernels.BLOCK_K, moe_kernels.NUM_WARPS,
                moe_kernels.NUM_STAGES)]
    if args.sweep:
        configs = list(itertools.product([None, 16], [32, 64, 128], [64, 128, 256], [4], [3, 4]))
    res: dict = {"bench": "moe", "experts": e, "topk": args.topk, "hidden": d, "inter": i,
                 "route_split_rows": args.route_split_rows}
    for t in args.tokens:
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, generator=g)
        ids = torch.stack([torch.randperm(e, device="cuda", generator=g)[: args.topk] for _ in range(t)])
        used = int(ids.unique().numel())
        ref = grouped(x, ids, w13s[0], w2s[0]).float()
        base = time_graph(lambda x=x, ids=ids: [grouped(x, ids, w13s[j], w2s[j]) for j in range(layers)]) / layers
        best = None
        for cfg in configs:
            (moe_kernels.BLOCK_M, moe_kernels.BLOCK_N, moe_kernels.BLOCK_K, moe_kernels.NUM_WARPS,
             moe_kernels.NUM_STAGES) = cfg
            try:
                out = moe_kernels.fused_experts(x, ids, w13s[0], w2s[0]).float()
                us = time_graph(lambda x=x, ids=ids: [moe_kernels.fused_experts(x, ids, w13s[j], w2s[j])
                                         for j in range(layers)]) / layers
            except Exception as exc:  # a config that does not fit shared memory
                print(f"  T={t} config {cfg}: {type(exc).__name__}")
                continue
            err = float((out - ref).abs().max() / ref.abs().max())
            if args.sweep:
                print(f"  T={t} config {cfg}: {us:8.1f} µs  err {err:.2e}")
            if best is None or us < best[0]:
                best = (us, cfg, err)
        assert best is not None
        us, cfg, err = best
        bw = used * expert_bytes / (us * 1e-6) / 1e12
        print(f"T={t:4d} ({used} experts used): grouped GEMM {base:8.1f} µs, fused {us:8.1f} µs "
              f"({base / us:.2f}x, {bw:.2f} TB/s of expert weights, config {cfg}, max rel diff {err:.1e})")
        res[f"t{t}"] = {"grouped_us": round(base, 1), "fused_us": round(us, 1), "speedup": round(base / us, 3),
                        "fused_tb_s": round(bw, 3), "experts_used": used, "config": cfg}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
