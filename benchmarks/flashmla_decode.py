"""Our MLA decode kernel (engine/mla_decode.py) against FlashMLA's sm90 dense decode on the same paged latents,
bf16 rows and fp8 rows (the ``fp8`` KV format: 576 e4m3 values a token, one per-tensor scale), one Hopper GPU:
would FlashMLA's FP8 kernel reach issue 39's FP8 KV target (1.2x bf16 KV at batch 64 x 8k) where ours is at
parity with bf16 rows on an H200?

FlashMLA comes from PyPI as ``sgl-flash-mla`` (SGLang's build, abi3, torch's stable ABI); its sm90 dense kernels
are the "legacy" half (``use_legacy=True``), and its fp8 dense kernel takes q in e4m3 with ``descale_q`` and the
cache's per-tensor ``descale_k``. It needs blocks of 64 tokens (``page_block_size``), so both kernels run on
64-token blocks here. Without the package the JSON line says why.

  bash scripts/gpu_carry.sh flashmla     # here: .whl/sgl_flash_mla-*.whl; there:
  python3 -m zipfile -e .whl/sgl_flash_mla-*.whl /tmp/fmx
  PYTHONPATH=/tmp/fmx:$PWD python3 benchmarks/flashmla_decode.py --batches 64 256 --contexts 8192

Per case: ``ours_us`` (CUDA graph replays, L2 flushed: ``mla_decode.measure``), ``fm_us`` (the same), and
FlashMLA's max error against ``mla_decode_reference`` on two rows, over the reference's largest magnitude. Ends
with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.mla_decode import make_case, measure, time_ms  # noqa: E402
from engine.mla_decode import mla_decode_reference  # noqa: E402

PAGE, HEADS, LAT, SCALE = 64, 16, 512, 192**-0.5


def flashmla_call(fi: Any, case: dict, kv: str) -> Any:
    """A no-argument call of FlashMLA's sm90 dense decode on ``case``'s cache -> (out [B, 1, H, L], lse)."""
    cache, tables, lens = case["cache"], case["tables"].int(), case["lens"].int()
    q = torch.cat([case["q_lat"], case["q_pe"]], -1).unsqueeze(1).contiguous()  # [B, 1, H, L + R]
    k = cache.view(cache.shape[0], PAGE, 1, cache.shape[-1])
    sched, _ = fi.get_mla_metadata()
    if kv == "auto":
        return lambda: fi.flash_mla_with_kvcache(q, k, tables, lens, LAT, sched, softmax_scale=SCALE, use_legacy=True)
    meta = fi.get_mla_decoding_metadata(lens, HEADS, 1, HEADS, is_fp8_kvcache=True, use_legacy=True)
    sched.tile_scheduler_metadata, sched.num_splits = meta[0], meta[1]
    descale_k = torch.tensor([case["fmt"].scale], dtype=torch.float32, device=q.device)
    q_scale = (q.float().abs().amax().clamp(min=1e-6) / 448.0).reshape(1)
    q8 = (q.float() / q_scale).to(torch.float8_e4m3fn)
    return lambda: fi.flash_mla_with_kvcache(q8, k, tables, lens, LAT, sched, softmax_scale=SCALE,
                                             is_fp8_kvcache=True, use_legacy=True, descale_q=q_scale,
                                             descale_k=descale_k)


def one_case(fi: Any, kv: str, b: int, ctx: int, flush: torch.Tensor, repeats: int) -> dict:
    dev = flush.device
    case = make_case(b, ctx, HEADS, PAGE, dev, kv)
    row: dict[str, Any] = {"kv": kv, "batch": b, "context": ctx,
                           "ours_us": measure(case, b, ctx, HEADS, PAGE, repeats, False, flush)["graph_us"]}
    if fi is None:
        return row
    try:
        call = flashmla_call(fi, case, kv)
        out, _ = call()
        ref, _ = mla_decode_reference(case["q_lat"][:2], case["q_pe"][:2], case["cache"], case["tables"][:2],
                                      case["lens"][:2], SCALE, kv_format=case["fmt"] if kv != "auto" else None)
        row["fm_err"] = round(float((out[:2, 0].float() - ref).abs().max() / ref.abs().max()), 5)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        row["fm_us"] = round(time_ms(graph.replay, flush, repeats) * 1e3, 2)
        row["ours_over_fm"] = round(row["ours_us"] / row["fm_us"], 3)
    except (RuntimeError, AssertionError, TypeError) as e:  # an argument it refuses, or a kernel it lacks
        row["fm_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 8192])
    ap.add_argument("--kv-cache-dtype", nargs="+", choices=["auto", "fp8"], default=["auto", "fp8"])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "flashmla_decode", "skipped": "needs a CUDA GPU"}))
        return
    try:
        from flash_mla import flash_mla_interface as fi
    except Exception as e:  # not installed, or its extension does not load here
        fi, why = None, f"flash_mla does not import: {type(e).__name__}: {e}"
        print(why, file=sys.stderr)
    else:
        why = None
    flush = torch.empty(64 * 2**20, dtype=torch.float32, device="cuda")  # 256 MB: more than L2
    rows = []
    for kv in args.kv_cache_dtype:
        for b in args.batches:
            for ctx in args.contexts:
                rows.append(one_case(fi, kv, b, ctx, flush, args.repeats))
                print(rows[-1], flush=True)
                torch.cuda.empty_cache()
    print(json.dumps({"bench": "flashmla_decode", "device": torch.cuda.get_device_name(), "flash_mla": why or "present",
                      "results": rows}))


if __name__ == "__main__":
    main()
