"""Our block-FP8 routed experts against DeepGEMM's grouped FP8 GEMMs at prefill sizes, on one Hopper GPU:
would a library kernel reach the FP8 prefill target (issue 39's 1.25x over bf16) where our Triton kernels
run at about bf16 cuBLAS's rate?

Per shape (V2-Lite / V3 experts, uniformly random top-k routing, replayed from CUDA graphs):

- ``ours_us``: the whole routed experts as the engine runs them (``moe_kernels.fused_experts`` with block
  scales: the activations quantized, rows routed, the gate-up GEMM with SiLU and the second quantization, the
  down GEMM);
- ``dg_gate_up_us`` / ``dg_down_us``: DeepGEMM's ``m_grouped_fp8_gemm_nt_contiguous`` on the same weights and
  the same rows, already quantized and grouped by expert (each expert's rows padded to DeepGEMM's alignment):
  the two GEMMs alone, without the glue around them, so ``ours_vs_dg_gemms`` bounds what adopting them can
  give;
- each DeepGEMM product's error against the same product of the dequantized operands in fp32 (a norm over
  the first experts' rows). The operands' 128-groups and blocks have unequal magnitudes, so a scale read from
  the wrong one shows as a large error.

  python benchmarks/fp8_grouped_gemm.py                       # V2-Lite and V3, 4k and 16k tokens
  python benchmarks/fp8_grouped_gemm.py --preset v3 --tokens 4096

DeepGEMM comes from PyPI as ``sgl-deep-gemm`` (with ``apache-tvm-ffi``); it compiles its kernels at first use
with NVCC from ``$CUDA_HOME`` (its NVRTC mode fails: NVRTC has no C++ standard library headers). Without it the
JSON line says why. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.moe import time_graph  # noqa: E402
from engine import fp8_kernels, moe_kernels  # noqa: E402
from engine.fp8 import dequantize_blocks, quantize_blocks  # noqa: E402

EXPERTS = {"v2-lite": (64, 2048, 1408, 6), "v3": (256, 7168, 2048, 8)}  # (E, D, I, top-k)
CHECKED_EXPERTS = 2  # the experts whose rows the error check recomputes in fp32


def load_deep_gemm() -> tuple[Any, str | None]:
    try:
        import deep_gemm
    except Exception as e:  # not installed, or its module failed to load (no CUDA headers, ...)
        return None, f"deep_gemm does not import: {type(e).__name__}: {e}"
    return deep_gemm, None


def grouped_rows(ids: torch.Tensor, e: int, align: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k ids [T, K] -> (the (token, choice) row of each padded slot or -1 [M], each slot's expert or -1 for
    padding [M], rows per expert [E]): every expert's rows contiguous, padded to a multiple of ``align``."""
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=e)
    padded = (counts + align - 1) // align * align
    starts = torch.cumsum(padded, 0) - padded
    m = int(padded.sum())
    rank_in_expert = torch.arange(flat.numel(), device=ids.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    slot = starts[flat[order]] + rank_in_expert
    rows = torch.full((m,), -1, dtype=torch.long, device=ids.device)
    rows[slot] = order
    experts = torch.full((m,), -1, dtype=torch.int32, device=ids.device)
    experts[slot] = flat[order].to(torch.int32)
    return rows, experts, counts


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm().clamp_min(1e-30))


def checked_product(q: torch.Tensor, s: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, experts: torch.Tensor,
                    out: torch.Tensor) -> float:
    """The error of DeepGEMM's ``out`` on the first CHECKED_EXPERTS experts' rows against fp32 products of the
    dequantized activations (per 1 x 128 group) and weights (per 128 x 128 block)."""
    errs = []
    for j in range(CHECKED_EXPERTS):
        sel = (experts == j).nonzero().flatten()
        if sel.numel() == 0:
            continue
        a = (q[sel].float().view(sel.numel(), -1, 128) * s[sel].unsqueeze(-1)).view(sel.numel(), -1)
        w = dequantize_blocks(wq[j], ws[j], dtype=torch.float32)
        errs.append(relative_error(out[sel], a @ w.t()))
    return max(errs) if errs else float("nan")


def timed(fn: Any) -> tuple[float, str]:
    """(µs per call, how): from CUDA graph replays ("graph"), or from CUDA events over eager calls ("eager",
    host work included) if the kernel does not capture."""
    try:
        return time_graph(fn), "graph"
    except RuntimeError as e:
        print(f"no CUDA graph ({e}); timing eager calls", file=sys.stderr)
        torch.cuda.synchronize()
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / 50, "eager"


def spread(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """[rows, cols]: a log-normal factor per row and group of 128 columns (an activation's 1 x 128 groups). Groups
    and blocks of unequal magnitude make a scale read from the wrong one show in the error check; random data of
    one magnitude would hide it."""
    return torch.exp(torch.randn(rows, cols // 128, device="cuda", generator=g)).repeat_interleave(128, 1)


def block_spread(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """[n, k]: a log-normal factor per 128 x 128 block (a weight's)."""
    return spread(n // 128, k, g).repeat_interleave(128, 0)


def dg_scales(dg: Any, s: torch.Tensor) -> torch.Tensor:
    """Activation scales [M, K/128] in the layout DeepGEMM's sm90 kernels read (MN-major, TMA-aligned)."""
    return dg.get_mn_major_tma_aligned_tensor(s) if hasattr(dg, "get_mn_major_tma_aligned_tensor") else s


def dg_gemm(dg: Any, q: torch.Tensor, sf: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, out: torch.Tensor,
            experts: torch.Tensor) -> None:
    dg.m_grouped_fp8_gemm_nt_contiguous((q, sf), (wq, ws), out, experts)


def one_shape(dg: Any, preset: str, t: int, g: torch.Generator) -> dict:
    e, d, i, top = EXPERTS[preset]
    gate_up = [quantize_blocks(torch.randn(2 * i, d, device="cuda", generator=g) / d**0.5 * block_spread(2 * i, d, g))
               for _ in range(e)]
    w13q, w13s = torch.stack([q for q, _ in gate_up]), torch.stack([s for _, s in gate_up])
    del gate_up
    down = [quantize_blocks(torch.randn(d, i, device="cuda", generator=g) / i**0.5 * block_spread(d, i, g))
            for _ in range(e)]
    w2q, w2s = torch.stack([q for q, _ in down]), torch.stack([s for _, s in down])
    del down
    x = (torch.randn(t, d, device="cuda", generator=g) * spread(t, d, g)).to(torch.bfloat16)
    ids = torch.rand(t, e, device="cuda", generator=g).argsort(dim=1)[:, :top].contiguous()
    m = t * top
    flops_gate_up, flops_down = 2 * m * 2 * i * d, 2 * m * d * i

    ours, how = timed(lambda: moe_kernels.fused_experts(x, ids, w13q, w2q, w13s, w2s))
    row: dict[str, Any] = {"preset": preset, "tokens": t, "rows": m, "ours_us": round(ours, 1), "ours_timed": how,
                           "ours_tflops": round((flops_gate_up + flops_down) / ours / 1e6, 1)}
    if dg is None:
        return row
    try:
        row.update(deep_gemm_columns(dg, x, ids, w13q, w13s, w2q, w2s, ours, (flops_gate_up, flops_down)))
    except RuntimeError as err:  # its kernel's compile or a check of its inputs failed: say so in the row
        row["dg_error"] = str(err)[:2000]
    return row


def deep_gemm_columns(dg: Any, x: torch.Tensor, ids: torch.Tensor, w13q: torch.Tensor, w13s: torch.Tensor,
                      w2q: torch.Tensor, w2s: torch.Tensor, ours: float, flops: tuple[int, int]) -> dict[str, Any]:
    """DeepGEMM's two GEMMs on ``one_shape``'s rows: times (``flops``, the two GEMMs' on the real rows, give the
    TFLOP/s; it also computes the padding rows, ``padded_rows``), errors, and our whole experts' time over
    theirs."""
    e, top, d, i = w13q.shape[0], ids.shape[1], x.shape[1], w2q.shape[2]
    flops_gate_up, flops_down = flops
    row: dict[str, Any] = {}

    rows, experts, _ = grouped_rows(ids, e, dg.get_mk_alignment_for_contiguous_layout())
    xs = torch.zeros(rows.numel(), d, dtype=torch.bfloat16, device="cuda")
    real = rows >= 0
    xs[real] = x[rows[real] // top]
    aq, asf = fp8_kernels.quantize_groups(xs)
    h13 = torch.empty(rows.numel(), 2 * i, dtype=torch.bfloat16, device="cuda")
    asf_dg = dg_scales(dg, asf)
    dg_gemm(dg, aq, asf_dg, w13q, w13s, h13, experts)  # compiles its kernel (outside the timed graph)
    gate, up = h13.float().chunk(2, dim=-1)
    hq, hsf = fp8_kernels.quantize_groups((F.silu(gate) * up).to(torch.bfloat16))
    h2 = torch.empty(rows.numel(), d, dtype=torch.bfloat16, device="cuda")
    hsf_dg = dg_scales(dg, hsf)
    dg_gemm(dg, hq, hsf_dg, w2q, w2s, h2, experts)
    row["gate_up_err"] = round(checked_product(aq, asf, w13q, w13s, experts, h13), 5)
    row["down_err"] = round(checked_product(hq, hsf, w2q, w2s, experts, h2), 5)

    t13, how13 = timed(lambda: dg_gemm(dg, aq, asf_dg, w13q, w13s, h13, experts))
    t2, how2 = timed(lambda: dg_gemm(dg, hq, hsf_dg, w2q, w2s, h2, experts))
    row.update({"padded_rows": rows.numel(), "dg_gate_up_us": round(t13, 1), "dg_down_us": round(t2, 1),
                "dg_timed": how13 if how13 == how2 else f"{how13}/{how2}",
                "dg_gate_up_tflops": round(flops_gate_up / t13 / 1e6, 1),
                "dg_down_tflops": round(flops_down / t2 / 1e6, 1),
                "ours_vs_dg_gemms": round(ours / (t13 + t2), 3)})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", nargs="+", default=list(EXPERTS), choices=list(EXPERTS))
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "fp8_grouped_gemm", "skipped": "needs a CUDA GPU"}))
        return
    dg, why = load_deep_gemm()
    if why:
        print(why, file=sys.stderr)
    g = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for preset in args.preset:
        for t in args.tokens:
            row = one_shape(dg, preset, t, g)
            print(row, flush=True)
            results.append(row)
            torch.cuda.empty_cache()
    print(json.dumps({"bench": "fp8_grouped_gemm", "device": torch.cuda.get_device_name(),
                      "deep_gemm": getattr(dg, "__version__", "present") if dg is not None else why,
                      "results": results}))


if __name__ == "__main__":
    main()
