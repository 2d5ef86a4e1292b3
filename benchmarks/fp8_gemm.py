"""Block-FP8 GEMMs (W8A8, DeepSeek's 128 x 128 weight blocks, 1 x 128 activation groups) against bf16, on
one H200, replayed from CUDA graphs:

- dense linears: bf16 ``F.linear`` vs our Triton kernel (``engine.fp8_kernels.linear``: quantize + GEMM)
  vs torch's own block-scaled ``torch._scaled_mm`` (cuBLAS; the activation quantized by our kernel, so
  the two FP8 columns differ only in the GEMM) where this torch has it, vs DeepGEMM's ``fp8_gemm_nt``
  (``engine.dense_deep_gemm.linear``: quantize + GEMM, the engine's prefill form) where it is installed
  on sm90 and the shape is whole 128-blocks;
- routed experts: the engine's bf16 path (fused Triton MoE up to ``MAX_ROWS`` rows, grouped GEMM above)
  vs the FP8 experts (``engine.moe_kernels.fused_experts`` with scales: the fused kernels, or from
  ``FP8_TMA_MIN_ROWS`` rows an expert their TMA-fed form; ``--tma-min-rows 0 inf`` times both forms);
- the MoE layer's experts with its shared ones (``layer_us``): bf16 (the shared MLP's three GEMMs beside the
  routed experts), FP8 routed experts with that bf16 MLP, and FP8 with the shared experts as slots of the
  stack (the engine's FP8 form), each with its ``combine``.

  python benchmarks/fp8_gemm.py                 # V2-Lite and V3 shapes
  python benchmarks/fp8_gemm.py --preset v2-lite --rows 1 64 256

Each result carries its max error relative to the bf16 product of the dequantized weights. Ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.moe import grouped, time_graph  # noqa: E402
from engine import dense_deep_gemm, fp8_kernels, moe_deep_gemm, moe_kernels  # noqa: E402
from engine.fp8 import dequantize_blocks, quantize_blocks  # noqa: E402

# (name, N, K) of the linears DeepSeek quantizes; experts (E, D, I, top-k)
DENSE = {
    "v2-lite": [("q_proj", 3072, 2048), ("kv_a_proj", 576, 2048), ("kv_b_proj", 4096, 512), ("o_proj", 2048, 2048),
                ("shared_gate", 2816, 2048), ("shared_down", 2048, 2816), ("dense_gate", 10944, 2048),
                ("dense_down", 2048, 10944)],
    "v3": [("q_a_proj", 1536, 7168), ("q_b_proj", 24576, 1536), ("kv_a_proj", 576, 7168), ("kv_b_proj", 32768, 512),
           ("o_proj", 7168, 16384),
           ("shared_gate", 2048, 7168), ("shared_down", 7168, 2048), ("dense_gate", 18432, 7168),
           ("dense_down", 7168, 18432)],
}
EXPERTS = {"v2-lite": (64, 2048, 1408, 6, 2), "v3": (256, 7168, 2048, 8, 1)}  # + n_shared_experts


# Layouts of the two scale tensors torch._scaled_mm might take for 1x128 x 128x128 block scaling (torch's
# docs do not say; the first whose product matches the reference is used): (activation scales [M, K/128],
# weight scales [N/128, K/128]) -> what is passed.
SCALE_LAYOUTS = {
    "a_mmajor,b_t": lambda s, ws: (s.t().contiguous().t(), ws.t()),
    "a_mmajor,b_t_contig": lambda s, ws: (s.t().contiguous().t(), ws.t().contiguous()),
    "a_rowmajor,b_t": lambda s, ws: (s, ws.t()),
    "a_mmajor,b": lambda s, ws: (s.t().contiguous().t(), ws),
}


def scaled_mm(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, layout: str) -> torch.Tensor:
    """torch's block-scaled FP8 GEMM (cuBLAS) on our quantized activation and the block-FP8 weight."""
    sa, sb = SCALE_LAYOUTS[layout](s, ws)
    return torch._scaled_mm(q, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


def scaled_mm_layout(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                     ref: torch.Tensor) -> tuple[str | None, str]:
    """The first scale layout torch accepts whose product matches ``ref`` (5%), or None and why not."""
    why = "torch has no _scaled_mm"
    for name in SCALE_LAYOUTS if hasattr(torch, "_scaled_mm") else ():
        try:
            err = float((scaled_mm(q, s, w, ws, name).float() - ref).abs().max() / ref.abs().max())
        except Exception as exc:  # this layout (or block scaling at all) not accepted by this build
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            continue
        if err < 0.05:
            return name, ""
        why = f"layout {name}: error {err:.3f}"
    return None, why


def dense(preset: str, rows: list[int], res: dict) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    deep_gemm = fp8_kernels.sm90(torch.cuda.current_device()) and moe_deep_gemm.library() is not None
    for name, n, k in DENSE[preset]:
        w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
        wq, ws = quantize_blocks(w)
        wd = dequantize_blocks(wq, ws, dtype=torch.bfloat16)
        for m in rows:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            ref = F.linear(x, wd).float()
            bf16 = time_graph(lambda x=x, wd=wd: F.linear(x, wd))
            ours = time_graph(lambda x=x, wq=wq, ws=ws: fp8_kernels.linear(x, wq, ws))
            err = float((fp8_kernels.linear(x, wq, ws).float() - ref).abs().max() / ref.abs().max())
            row = {"bf16_us": round(bf16, 2), "triton_us": round(ours, 2), "triton_vs_bf16": round(bf16 / ours, 3),
                   "triton_err": round(err, 4),
                   "triton_tflops": round(2 * m * n * k / (ours * 1e-6) / 1e12, 1)}
            q, s = fp8_kernels.quantize_groups(x)
            layout, why = scaled_mm_layout(q, s, wq, ws, ref)
            if layout is None:
                row["scaled_mm"] = why
            else:
                got = scaled_mm(q, s, wq, ws, layout).float()
                row["scaled_mm_err"] = round(float((got - ref).abs().max() / ref.abs().max()), 4)
                gemm = time_graph(lambda q=q, s=s, wq=wq, ws=ws, lay=layout: scaled_mm(q, s, wq, ws, lay))
                quant = time_graph(lambda x=x: fp8_kernels.quantize_groups(x))
                row["scaled_mm_us"] = round(gemm + quant, 2)  # with our activation quantization, as ours
                row["scaled_mm_vs_bf16"] = round(bf16 / (gemm + quant), 3)
                row["scaled_mm_layout"] = layout
            if deep_gemm and n % 128 == 0 and k % 128 == 0:
                dg_out = dense_deep_gemm.linear(x, wq, ws)
                if dg_out is not None:
                    row["deep_gemm_err"] = round(float((dg_out.float() - ref).abs().max() / ref.abs().max()), 4)
                    dg = time_graph(lambda x=x, wq=wq, ws=ws: dense_deep_gemm.linear(x, wq, ws))
                    row["deep_gemm_us"] = round(dg, 2)
                    row["deep_gemm_vs_bf16"] = round(bf16 / dg, 3)
            print(f"{preset} {name:15s} {n:6d}x{k:6d} M={m:6d}: {row}", flush=True)
            res[f"{preset}/{name}/m{m}"] = row


# (rows per tile, gate-up warps, stages, down columns per tile, down warps) tried by --sweep; None: the table's
KNOBS = ("FP8_BLOCK_M", "FP8_WARPS", "FP8_STAGES", "FP8_DOWN_BN", "FP8_DOWN_WARPS")
DEFAULT = (None,) * len(KNOBS)
FP8_TILES = [DEFAULT] + [(bm, w, st, dbn, dw) for bm in (16, 32, 64, 128) for w in (4, 8) for st in (3, 4)
                         for dbn, dw in ((64, 4), (128, 4), (128, 8)) if dbn == 64 or bm >= 64 or dw == 4]


# The TMA form's tiles tried by --sweep where it applies (moe_kernels.FP8_TMA_TILES): gate-up (rows, warps, stages),
# then down (rows, columns, warps, stages) with the best gate-up
TMA_GATE_UP = ((128, 8, 4), (128, 8, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3), (64, 8, 4))
TMA_DOWN = ((64, 128, 4, 4), (64, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4), (64, 64, 4, 4))


def set_tiles(cfg: tuple) -> None:
    for knob, value in zip(KNOBS, cfg, strict=True):
        setattr(moe_kernels, knob, value)


def sweep_fused(t: int, timed: Callable[[], float]) -> dict[tuple, float]:
    """µs of the fused form at each tile of FP8_TILES."""
    tried = {}
    for cfg in FP8_TILES[1:]:
        set_tiles(cfg)
        try:
            tried[cfg] = timed()
        except Exception as exc:  # a tile that does not fit shared memory or registers
            print(f"  T={t} tile {cfg}: {type(exc).__name__}")
    set_tiles(DEFAULT)
    return tried


def sweep_tma(t: int, timed: Callable[[], float]) -> dict[tuple, float]:
    """µs of the TMA form: each gate-up tile of TMA_GATE_UP with the table's down tile, then each down tile of
    TMA_DOWN with the fastest gate-up."""
    table = moe_kernels.FP8_TMA_TILES
    tried: dict[tuple, float] = {}

    def run(tiles: tuple) -> None:
        if tiles in tried:  # the down list starts with the table's down tile, already timed with the best gate-up
            return
        moe_kernels.FP8_TMA_TILES = tiles
        try:
            tried[tiles] = timed()
        except Exception as exc:  # a tile that does not fit shared memory or registers
            print(f"  T={t} TMA tiles {tiles}: {type(exc).__name__}")
        finally:
            moe_kernels.FP8_TMA_TILES = table

    for gate_up in TMA_GATE_UP:
        run(gate_up + table[3:])
    best = min(tried, key=tried.__getitem__, default=table)
    for down in TMA_DOWN:
        run(best[:3] + down)
    return tried


def experts(preset: str, tokens: list[int], res: dict, sweep: bool) -> None:
    """The routed experts alone (bf16 / FP8 columns), and the whole MoE layer's experts with its shared ones:
    bf16 (the shared MLP as three GEMMs beside the routed experts), FP8 routed with that bf16 MLP, and FP8 with
    the shared experts as slots of the stack (``fused_experts(shared=S)``, the engine's FP8 form), each
    with its ``combine``."""
    e, d, i, top, sh = EXPERTS[preset]
    g = torch.Generator(device="cuda").manual_seed(1)
    layers = 4 if preset == "v2-lite" else 1  # cycled so a call does not find its weights in L2
    w13q, w13s, w2q, w2s, w13d, w2d = [], [], [], [], [], []
    for _ in range(layers):  # e routed experts, then the sh shared experts' slots
        a = [quantize_blocks(torch.randn(i, d, device="cuda", generator=g) / d**0.5) for _ in range(2 * (e + sh))]
        w13q.append(torch.stack([torch.cat([a[2 * j][0], a[2 * j + 1][0]]) for j in range(e + sh)]))
        w13s.append(torch.stack([torch.cat([a[2 * j][1], a[2 * j + 1][1]]) for j in range(e + sh)]))
        b = [quantize_blocks(torch.randn(d, i, device="cuda", generator=g) / i**0.5) for _ in range(e + sh)]
        w2q.append(torch.stack([q for q, _ in b]))
        w2s.append(torch.stack([s for _, s in b]))
        w13d.append(torch.stack([torch.cat([dequantize_blocks(*a[2 * j], dtype=torch.bfloat16),
                                            dequantize_blocks(*a[2 * j + 1], dtype=torch.bfloat16)])
                                 for j in range(e + sh)]))
        w2d.append(torch.stack([dequantize_blocks(q, s, dtype=torch.bfloat16) for q, s in b]))
        del a, b
    # the bf16 shared MLP as the engine's MLP holds it (gate_proj, up_proj, down_proj), from the same weights
    mlp = [(torch.cat([w[e + j, :i] for j in range(sh)]), torch.cat([w[e + j, i:] for j in range(sh)]),
            torch.cat([w2[e + j] for j in range(sh)], dim=1)) for w, w2 in zip(w13d, w2d)]
    for t in tokens:
        x = torch.randn(t, d, device="cuda", generator=g).to(torch.bfloat16)
        ids = torch.rand(t, e, device="cuda", generator=g).argsort(dim=1)[:, :top].contiguous()

        def bf16(j: int, x: torch.Tensor = x, ids: torch.Tensor = ids) -> torch.Tensor:
            if moe_kernels.supported(x, ids.numel()):
                return moe_kernels.fused_experts(x, ids, w13d[j][:e], w2d[j][:e])
            return grouped(x, ids, w13d[j][:e], w2d[j][:e])

        def fp8(j: int, x: torch.Tensor = x, ids: torch.Tensor = ids) -> torch.Tensor:
            return moe_kernels.fused_experts(x, ids, w13q[j][:e], w2q[j][:e], w13s[j][:e], w2s[j][:e])

        def shared_mlp(j: int, x: torch.Tensor = x) -> torch.Tensor:
            gate, up, down = mlp[j]
            return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)

        wt = torch.rand(t, top, device="cuda", generator=g)
        layer = {  # the MoE layer's experts, each form with its combine
            "bf16": lambda j, wt=wt, b=bf16, m=shared_mlp: moe_kernels.combine(b(j), wt, shared=m(j)),
            "fp8_bf16_shared": lambda j, wt=wt, f=fp8, m=shared_mlp: moe_kernels.combine(f(j), wt, shared=m(j)),
            "fp8_shared_slots": lambda j, wt=wt, x=x, ids=ids: moe_kernels.combine(
                moe_kernels.fused_experts(x, ids, w13q[j], w2q[j], w13s[j], w2s[j], shared=sh), wt, slots=sh),
        }

        ref = grouped(x, ids, w13d[0][:e], w2d[0][:e]).float()
        err = float((fp8(0).float() - ref).abs().max() / ref.abs().max())
        iters = 20 if t > 1024 else 200
        base = time_graph(lambda: [bf16(j) for j in range(layers)], iters=iters) / layers
        tma = moe_kernels.tma_form(x, t * top, e, d, i)

        def timed(fp8: Callable[[int], torch.Tensor] = fp8, iters: int = iters) -> float:
            return time_graph(lambda: [fp8(j) for j in range(layers)], iters=iters) / layers

        tried: dict[tuple, float] = {DEFAULT: timed()}
        if sweep:  # the tiles of the form these tokens take
            tried.update(sweep_tma(t, timed) if tma else sweep_fused(t, timed))
        best = min(tried, key=tried.__getitem__)
        ours = tried[DEFAULT]
        flops = 2 * t * top * 3 * d * i
        row = {"bf16_us": round(base, 1), "fp8_us": round(ours, 1), "fp8_vs_bf16": round(base / ours, 3),
               "tiles": list(moe_kernels.fp8_tiles(t * top, e)),
               "fp8_form": "tma" if tma else "fused",
               "fp8_err": round(err, 4), "fp8_tflops": round(flops / (ours * 1e-6) / 1e12, 1),
               "bf16_path": "fused" if moe_kernels.supported(x, ids.numel()) else "grouped_mm"}
        lay = {name: time_graph(lambda fn=fn: [fn(j) for j in range(layers)], iters=iters) / layers
               for name, fn in layer.items()}
        want = layer["bf16"](0).float()
        row["layer_us"] = {name: round(us, 1) for name, us in lay.items()}
        row["layer_slots_vs_bf16_shared"] = round(lay["fp8_bf16_shared"] / lay["fp8_shared_slots"], 3)
        row["layer_fp8_vs_bf16"] = round(lay["bf16"] / lay["fp8_shared_slots"], 3)
        row["layer_fp8_err"] = round(float((layer["fp8_shared_slots"](0).float() - want).abs().max()
                                           / want.abs().max()), 4)
        if sweep:
            print(f"  T={t} sweep (us): " + ", ".join(f"{list(c)}: {us:.1f}" for c, us in tried.items()))
            row["best_tile"], row["best_us"] = list(best), round(tried[best], 1)
            row["best_vs_bf16"] = round(base / tried[best], 3)
        print(f"{preset} experts {e}x{d}x{i} top{top} T={t:6d}: {row}", flush=True)
        res[f"{preset}/experts/t{t}"] = row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", nargs="+", default=["v2-lite", "v3"], choices=list(DENSE))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256, 4096, 16384])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 1024, 4096, 16384])
    ap.add_argument("--skip-dense", action="store_true")
    ap.add_argument("--skip-experts", action="store_true")
    ap.add_argument("--sweep", action="store_true",
                    help="the FP8 experts at other tiles (best reported): FP8_TILES for the fused form, TMA_GATE_UP "
                         "and TMA_DOWN where the TMA form serves")
    ap.add_argument("--tma-min-rows", type=float, nargs="+", default=None,
                    help="the FP8 experts once per value of moe_kernels.FP8_TMA_MIN_ROWS (0: the TMA form at every "
                         "size, inf: the fused form at every size); default: the engine's")
    args = ap.parse_args()
    res: dict = {"bench": "fp8_gemm", "torch": torch.__version__, "device": torch.cuda.get_device_name()}
    for preset in args.preset:
        if not args.skip_dense:
            dense(preset, args.rows, res)
        if not args.skip_experts:
            for rows in args.tma_min_rows or [moe_kernels.FP8_TMA_MIN_ROWS]:
                moe_kernels.FP8_TMA_MIN_ROWS = rows
                part: dict = {}
                experts(preset, args.tokens, part, args.sweep)
                tag = "" if args.tma_min_rows is None else f"/tma_min_rows={rows:g}"
                res.update({k + tag: v for k, v in part.items()})
    print(json.dumps(res))


if __name__ == "__main__":
    main()
