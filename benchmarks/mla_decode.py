"""MLA decode attention on one GPU: the Triton split-KV kernel (engine/mla_decode.py) against the engine's
current path (gather every row's latents into a dense [B, T, L+R] copy, then fp32 einsums: what
``MLAttention._decode_absorbed`` does after the W_UK absorption), DeepSeek-V2-Lite shape, bf16.

  python benchmarks/mla_decode.py                              # B in {1, 8, 64, 256} x context {512, 4096, 32768}
  python benchmarks/mla_decode.py --batches 64 --contexts 4096 --heads 128
  python benchmarks/mla_decode.py --batches 64 256 --contexts 8192 --kv-cache-dtype auto fp8 fp8_ds_mla \
      --fp8-dots dequant fp16                              # the FP8 caches against bf16, same latents
  python benchmarks/mla_decode.py --batches 64 --contexts 8192 --kv-cache-dtype auto fp8 --no-baseline \
      --configs "" fp8_convert=compiler block_n=64:num_warps=8  # kernel variants, each on the same caches

Every row has the full context. Times are CUDA-event medians of single calls, with L2 flushed before
each call (a model's layers each read their own cache, so the cache never sits in L2): "eager" launches
from Python, "graph" replays the call captured in a CUDA graph (the GPU's own time: what x roof, GB/s and
TFLOP/s use); the speedup is eager torch over the eager kernel; "vs first" is the first format's time over this one's,
in the same config. "bytes" is what the kernel must read:
every row's latents (L+R values per token) and q; the roofline is those bytes at 4.8 TB/s (H200 HBM3e).
TFLOP/s shows when the tensor cores are the limit instead (H=128: ~240 flop per byte read). Combinations
whose cache (or the baseline's dense copies) does not fit are skipped.
The last line of output is one JSON object with all figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import unittest.mock
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine.mla_decode as mla_decode_mod  # noqa: E402
from engine import mla_decode_flashmla  # noqa: E402
from engine.forward_batch import gather_latents  # noqa: E402
from engine.kv_format import KV_CACHE_DTYPES, KVFormat  # noqa: E402
from engine.mla_decode import choose_num_splits, mla_decode, mla_decode_reference, workspace_for  # noqa: E402

HBM_BYTES_PER_S = 4.8e12  # H200


def time_ms(fn, flush: torch.Tensor, repeats: int) -> float:
    """Median milliseconds of one call (CUDA events), L2 flushed before each."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def baseline(q_lat, q_pe, flat_cache, tables, lens, max_len: int, page: int, lat: int, scale: float):
    """The engine's decode attention today (mla.py: _decode_absorbed + absorbed_attention, want_lse=False)."""
    pos = torch.arange(max_len, device=tables.device)
    mask = pos[None, :] < lens[:, None]
    kv = gather_latents(tables, pos, flat_cache, page)  # [B, T, L+R]
    qq = torch.cat((q_lat, q_pe), dim=-1)
    scores = torch.einsum("bhc,btc->bht", qq.float(), kv.float()) * scale
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    return torch.einsum("bht,btl->bhl", scores.softmax(dim=-1), kv[..., :lat].float())


def make_case(b: int, ctx: int, h: int, page: int, dev: torch.device, kv_cache_dtype: str = "auto") -> dict:
    """Shuffled paged cache of ``b`` rows of ``ctx`` tokens in the format, and queries (seeded by b and ctx:
    every format holds the same latents)."""
    dt, lat, rope = torch.bfloat16, 512, 64
    g = torch.Generator(device=dev).manual_seed(b * 100003 + ctx)
    blocks_per_row = -(-ctx // page)
    nblocks = b * blocks_per_row
    fmt = KVFormat(kv_cache_dtype, lat, rope, dt)
    cache = torch.randn(nblocks, page, lat + rope, device=dev, generator=g, dtype=dt)
    if fmt.quantized:  # the same latents in the stored format (a block at a time: the fp32 copy stays small)
        cache = torch.cat([fmt.encode(c.view(-1, lat + rope)).view(-1, page, fmt.row_width) for c in cache.split(4096)])
    tables = torch.randperm(nblocks, device=dev, generator=g).view(b, blocks_per_row)  # shuffled blocks
    lens = torch.full((b,), ctx, dtype=torch.long, device=dev)
    q_lat = torch.randn(b, h, lat, device=dev, generator=g, dtype=dt)
    q_pe = torch.randn(b, h, rope, device=dev, generator=g, dtype=dt)
    return dict(fmt=fmt, cache=cache, tables=tables, lens=lens, q_lat=q_lat, q_pe=q_pe)


def measure(case: dict, b: int, ctx: int, h: int, page: int, repeats: int, with_baseline: bool,
            flush: torch.Tensor) -> dict:
    dev, dt, lat, rope, scale = flush.device, torch.bfloat16, 512, 64, 192**-0.5
    fmt, cache, tables, lens, q_lat, q_pe = (case[k] for k in ("fmt", "cache", "tables", "lens", "q_lat", "q_pe"))
    kv_format = fmt if fmt.quantized else None
    splits = choose_num_splits(b, h, tables.shape[1] * page, dev)
    ws = workspace_for(b, h, lat, splits, dev)
    out = torch.empty(b, h, lat, dtype=dt, device=dev)

    def kernel() -> None:
        mla_decode(q_lat, q_pe, cache, tables, lens, scale, out=out, workspace=ws, num_splits=splits,
                   kv_format=kv_format)

    # Our kernel, even where mla_decode would hand fp8 rows of 64-token blocks to FlashMLA (flashmla_decode.py
    # times that one beside ours).
    with unittest.mock.patch.object(mla_decode_flashmla, "usable", lambda *a: False):
        kernel()  # compiles
        graph = torch.cuda.CUDAGraph()  # the same call captured: no host launch cost, as the engine will run it
        with torch.cuda.graph(graph):
            kernel()
    ref, _ = mla_decode_reference(q_lat[:2], q_pe[:2], cache, tables[:2], lens[:2], scale, kv_format=kv_format)
    rows = cache[:64] if kv_format is None else fmt.decode(cache[:64])
    err = float((out[:2].float() - ref).abs().max()) / float(rows[..., :lat].float().abs().max())
    ms = time_ms(kernel, flush, repeats)
    graph_ms = time_ms(graph.replay, flush, repeats)
    nbytes = b * ctx * fmt.row_bytes + b * h * (lat + rope) * 2
    roof_ms = nbytes / HBM_BYTES_PER_S * 1e3
    flops = 2 * b * h * ctx * (lat + rope + lat)  # scores and output: compute-bound at H=128 (~240 flop/byte)
    base_ms = None
    if with_baseline and kv_format is None:
        flat = cache.view(-1, lat + rope)
        try:
            base_ms = time_ms(lambda: baseline(q_lat, q_pe, flat, tables, lens, ctx, page, lat, scale),
                              flush, max(repeats // 5, 5))
        except torch.OutOfMemoryError:
            base_ms = None
    return {"splits": splits, "bytes": nbytes, "kernel_us": round(ms * 1e3, 2),
            "graph_us": round(graph_ms * 1e3, 2), "roofline_us": round(roof_ms * 1e3, 2),
            "x_roofline": round(graph_ms / roof_ms, 3), "gb_s": round(nbytes / graph_ms / 1e6, 1),
            "tflop_s": round(flops / graph_ms / 1e9, 1),
            "torch_us": round(base_ms * 1e3, 2) if base_ms else None,
            "speedup": round(base_ms / ms, 2) if base_ms else None, "max_err": err}


KNOBS = ("BLOCK_H", "BLOCK_N", "NUM_WARPS", "NUM_STAGES", "MAX_SPLITS", "MIN_SPLIT_TOKENS", "WAVE", "MAXNREG",
         "FP8_CONVERT", "OPAQUE_TILES")
STR_KNOBS = {"FP8_CONVERT": list(mla_decode_mod.FP8_CONVERT_CODE)}


def parse_config(text: str) -> dict:
    """``block_n=64:fp8_convert=ptx`` -> {"BLOCK_N": 64, "FP8_CONVERT": "ptx"} (knobs of engine/mla_decode.py)."""
    out = {}
    for part in filter(None, text.split(":")):
        name, _, value = part.partition("=")
        if name.upper() not in KNOBS:
            raise SystemExit(f"--configs: unknown knob {name!r} (knobs: {', '.join(k.lower() for k in KNOBS)})")
        knob = name.upper()
        if knob in STR_KNOBS and value not in STR_KNOBS[knob]:
            raise SystemExit(f"--configs: {name} is one of {', '.join(STR_KNOBS[knob])}")
        out[knob] = value if knob in STR_KNOBS else int(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 32768])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--page", type=int, default=16, help="block size")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--kv-cache-dtype", nargs="+", choices=KV_CACHE_DTYPES, default=["auto"],
                    help="cache formats, each measured on the same latents (ratios against the first)")
    ap.add_argument("--fp8-dots", nargs="+", choices=list(mla_decode_mod.FP8_DOTS_CODE),
                    default=[mla_decode_mod.FP8_DOTS], help="the fp8 format's dot operands, each measured")
    ap.add_argument("--configs", nargs="+", default=[""], metavar="KNOB=V:KNOB=V",
                    help="kernel variants, each measured on every case: knobs set on top of the flags' "
                         "(e.g. block_n=64:num_warps=8); the empty default is the flags alone")
    for knob in KNOBS:
        ap.add_argument(f"--{knob.lower().replace('_', '-')}", type=str if knob in STR_KNOBS else int,
                        choices=STR_KNOBS.get(knob), default=getattr(mla_decode_mod, knob),
                        help="kernel tuning knob (engine/mla_decode.py)")
    args = ap.parse_args()
    for knob in KNOBS:
        setattr(mla_decode_mod, knob, getattr(args, knob.lower()))
    base_knobs = {k: getattr(mla_decode_mod, k) for k in KNOBS}
    configs = [(c, parse_config(c)) for c in args.configs]
    if not torch.cuda.is_available():
        sys.exit("benchmarks/mla_decode.py needs a CUDA GPU")
    dev = torch.device("cuda")
    lat, rope, h, page = 512, 64, args.heads, args.page
    name = torch.cuda.get_device_name(dev)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)  # > the H200's 60 MB L2
    print(f"MLA decode on {name}: H={h}, L={lat}, R={rope}, block size {page}, bf16; roofline at "
          f"{HBM_BYTES_PER_S / 1e12:.1f} TB/s")
    print(f"{'B':>4} {'ctx':>6} {'format':>16} {'config':>28} {'splits':>6} {'MB read':>8} {'roof us':>8} "
          f"{'eager us':>9} {'graph us':>9} {'x roof':>7} {'GB/s':>6} {'TFLOP/s':>7} {'torch us':>9} {'speedup':>8} "
          f"{'err':>8} {'vs first':>8}")
    knobs = {k.lower(): v for k, v in base_knobs.items()}
    knobs["block_h, warps, stages"] = mla_decode_mod._config(h)  # 16-bit rows; 8-bit ones: mla_decode._tiles
    print("knobs:", knobs)
    res: dict = {"bench": "mla_decode", "device": name, "heads": h, "kv_lora_rank": lat, "rope": rope,
                 "block_size": page, "dtype": "bfloat16", "hbm_tb_s": HBM_BYTES_PER_S / 1e12, **knobs}
    variants = [(f, d) for f in args.kv_cache_dtype for d in (args.fp8_dots if f == "fp8" else [None])]
    for ctx in args.contexts:
        for b in args.batches:
            first: dict = {}  # per config: the first format's time
            for kv_dtype, dots in variants:
                label = kv_dtype + (f"/{dots}" if dots else "")
                cache_bytes = b * -(-ctx // page) * page * (lat + rope) * 2
                # the baseline holds the dense bf16 copy, its fp32 upcast, the fp32 latents and [B, H, T] scores
                base_bytes = b * ctx * ((lat + rope) * (2 + 4) + lat * 4 + h * 4 * 3)
                free = torch.cuda.mem_get_info(dev)[0]
                if cache_bytes > 0.8 * free:
                    print(f"{b:>4} {ctx:>6}  skipped: the cache ({cache_bytes / 2**30:.1f} GiB) does not fit")
                    res[f"b{b}_ctx{ctx}"] = "skipped"
                    continue
                if dots:
                    mla_decode_mod.FP8_DOTS = dots
                with_base = not args.no_baseline and cache_bytes + base_bytes < 0.8 * free
                case = make_case(b, ctx, h, page, dev, kv_dtype)
                for text, config in configs:
                    for knob, value in {**base_knobs, **config}.items():
                        setattr(mla_decode_mod, knob, value)
                    key = (f"b{b}_ctx{ctx}" + ("" if kv_dtype == "auto" else f"_{kv_dtype}")
                           + (f"_{dots}" if dots else "") + (f"_{text}" if text else ""))
                    try:
                        r = measure(case, b, ctx, h, page, args.repeats, with_base, flush)
                    except Exception as e:  # a variant past the GPU's shared memory or registers
                        if type(e).__name__ != "OutOfResources":
                            raise
                        print(f"{b:>4} {ctx:>6} {label:>16} {text or '-':>28}  skipped: {str(e)[:60]}")
                        res[key] = "out of resources"
                        continue
                    first.setdefault(text, r["graph_us"])
                    r["speedup_vs_first"] = round(first[text] / r["graph_us"], 3)
                    base = (f"{r['torch_us']:>9.1f} {r['speedup']:>7.1f}x" if r["torch_us"]
                            else f"{'skipped':>9} {'':>8}")
                    print(f"{b:>4} {ctx:>6} {label:>16} {text or '-':>28} {r['splits']:>6} {r['bytes'] / 1e6:>8.1f} "
                          f"{r['roofline_us']:>8.1f} {r['kernel_us']:>9.1f} {r['graph_us']:>9.1f} "
                          f"{r['x_roofline']:>7.2f} {r['gb_s']:>6.0f} {r['tflop_s']:>7.0f} {base} "
                          f"{r['max_err']:>8.1e} {r['speedup_vs_first']:>7.2f}x", flush=True)
                    res[key] = r
                del case
                torch.cuda.empty_cache()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
