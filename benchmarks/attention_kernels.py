"""MLA prefill attention kernels on a GPU: one causal prompt, and one PCP rank's share of it.

  python benchmarks/attention_kernels.py --tokens 32768 --pcp 2

Compares SDPA without LSE (what PCP1 uses for a prompt with no cached context) with the two fused
kernels that return the LSE (needed to merge parts: PCP runs, cached context): PyTorch's
FlashAttention-2 and cuDNN. Shapes are DeepSeek-V2-Lite's (16 heads, q/k 192, v 128 padded to 192).
Then what a step costs when its query length is new, as in serving (cuDNN plans each new shape).
The last line of output is one JSON object with all figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import attention_ops  # noqa: E402
from engine.parallel.pcp_attention import pcp_local_attention  # noqa: E402
from engine.parallel.pcp_split import zigzag_runs  # noqa: E402


def bench(fn, repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--pcp", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    args = ap.parse_args()
    n, h, scale = args.tokens, args.heads, 192**-0.5
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(n, h, 192, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    v = torch.randn(n, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    runs = zigzag_runs(n, args.pcp, 0)
    q_local = torch.cat([q[a:b] for a, b in runs])
    res: dict = {"bench": "attention_kernels", "device": torch.cuda.get_device_name(0), "tokens": n, "pcp": args.pcp}
    ms = bench(lambda: attention_ops.attention(q, k, v, scale, causal=True))
    print(f"sdpa (no lse), causal {n}: {ms:8.2f} ms")
    res["sdpa_causal_ms"] = round(ms, 3)
    ref = None
    for kernel in ("flash", "cudnn"):
        attention_ops.LSE_KERNEL = kernel
        try:
            out, lse = attention_ops.attention_lse(q, k, v, scale, causal=True)
        except RuntimeError as e:
            print(f"{kernel}: unavailable ({str(e).splitlines()[0]})")
            continue
        if ref is None:
            ref = (out.float(), lse)
        diff = max(float((out.float() - ref[0]).abs().max()), float((lse - ref[1]).abs().max()))
        full = bench(lambda: attention_ops.attention_lse(q, k, v, scale, causal=True))
        share = bench(lambda: pcp_local_attention(q_local, runs, k, v, scale))
        print(f"{kernel:5} (lse), causal {n}: {full:8.2f} ms; PCP{args.pcp} rank 0 share: {share:8.2f} ms "
              f"({full / share:.2f}x less); max diff vs flash {diff:.2e}")
        res.update({f"{kernel}_causal_ms": round(full, 3), f"{kernel}_pcp_share_ms": round(share, 3),
                    f"{kernel}_max_diff": diff})
    # What returning the LSE costs, per call, at the shapes of one PCP rank's pieces.
    attention_ops.LSE_KERNEL = "cudnn"
    m = n // (2 * args.pcp)
    for name, qs, ks, causal in (("square", m, m, True), ("prefix", m, n - m, False)):
        qq, kk, vv = q[:qs], k[:ks], v[:ks]
        t_no = bench(lambda qq=qq, kk=kk, vv=vv, c=causal: attention_ops._fused(qq, kk, vv, scale, c, lse=False))
        t_yes = bench(lambda qq=qq, kk=kk, vv=vv, c=causal: attention_ops._fused(qq, kk, vv, scale, c, lse=True))
        print(f"cudnn {name} {qs}x{ks}: {t_no:.3f} ms without LSE, {t_yes:.3f} ms with")
        res.update({f"cudnn_{name}_ms": round(t_no, 3), f"cudnn_{name}_lse_ms": round(t_yes, 3)})
    # Is cuDNN's causal mask aligned bottom-right when there are fewer queries than keys? Then a run
    # [a, b) could attend keys [0, b) in one call, with no LSE and no merge.
    a, b = n - m, n
    split = pcp_local_attention(q[a:b], [(a, b)], k, v, scale)[0]
    one = attention_ops._fused(q[a:b], k[:b], v[:b], scale, True, lse=False)[0]
    align_diff = float((one.float() - split.float()).abs().max())
    t_split = bench(lambda: pcp_local_attention(q[a:b], [(a, b)], k, v, scale))
    t_one = bench(lambda: attention_ops._fused(q[a:b], k[:b], v[:b], scale, True, lse=False))
    print(f"cudnn causal {m}x{b} in one call: max diff vs square+prefix {align_diff:.2e} "
          f"({'bottom-right' if align_diff < 0.05 else 'NOT bottom-right'}); {t_one:.3f} ms vs {t_split:.3f} ms split")
    res.update({"cudnn_bottom_right_diff": align_diff, "cudnn_one_call_ms": round(t_one, 3),
                "cudnn_split_ms": round(t_split, 3)})
    # Does cuDNN take v with its own head size (128), saving the padding to 192 and a third of PV?
    def cudnn_dv(qq: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
        t = [x.transpose(0, 1).unsqueeze(0) for x in (qq, kk, vv)]
        return torch.ops.aten._scaled_dot_product_cudnn_attention(*t, None, True, 0.0, True, False, scale=scale)[0]

    try:
        out = cudnn_dv(q, k, v)[0].transpose(0, 1)
        diff = float((out.float() - ref[0]).abs().max()) if ref is not None else float("nan")
        ms = bench(lambda: cudnn_dv(q, k, v))
        print(f"cudnn (lse) with v of 128, causal {n}: {ms:8.2f} ms; max diff vs flash {diff:.2e}")
        res.update({"cudnn_dv128_causal_ms": round(ms, 3), "cudnn_dv128_max_diff": diff})
    except RuntimeError as e:
        print(f"cudnn with v of 128: unavailable ({str(e).splitlines()[0]})")
        res["cudnn_dv128_causal_ms"] = None
    res["new_shapes"] = new_shapes(h, scale)
    print(json.dumps(res))


def new_shapes(h: int, scale: float, layers: int = 27) -> dict:
    """What a step costs in attention when its query length is new (serving: nearly every request):
    cuDNN builds an execution plan per new shape, once for all layers; FlashAttention has none. Per
    query length: the first call on a new shape and the next (milliseconds), and a step of ``layers``
    layers (the first call plus ``layers - 1`` more) for causal self-attention and for 2,048 tokens of
    cached context (prefix caching, chunked prefill)."""
    def ms(fn) -> float:  # noqa: ANN001
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    x = torch.randn(8, h, 192, device="cuda", dtype=torch.bfloat16)
    for kernel in ("cudnn", "flash"):  # each kernel's one-time start-up, outside the figures
        attention_ops.LSE_KERNEL = kernel
        attention_ops.attention_lse(x, x, x[..., :128].contiguous(), scale, True)
    out: dict = {}
    print(f"a new query length per step ({layers} layers): first call / again, and the step")
    for rows in (1024, 2048, 4096, 8192, 16384, 32768):
        for kind, causal in (("causal", True), ("ctx2k", False)):
            for kernel in ("cudnn", "flash"):
                attention_ops.LSE_KERNEL = kernel
                q = torch.randn(rows + 3, h, 192, device="cuda", dtype=torch.bfloat16)  # +3: never seen before
                keys = rows + 3 if causal else 2048
                k = torch.randn(keys, h, 192, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(keys, h, 128, device="cuda", dtype=torch.bfloat16)
                first = ms(lambda q=q, k=k, v=v, c=causal: attention_ops.attention_lse(q, k, v, scale, c))
                again = ms(lambda q=q, k=k, v=v, c=causal: attention_ops.attention_lse(q, k, v, scale, c))
                step = first + (layers - 1) * again
                out[f"{kernel}_{kind}_{rows}"] = {"first_ms": round(first, 2), "again_ms": round(again, 3),
                                                  "step_ms": round(step, 1)}
                print(f"  {rows:6} {kind:6} {kernel:5}: {first:7.2f} / {again:6.3f} ms, step {step:7.1f} ms")
    attention_ops.LSE_KERNEL = "auto"
    return out


if __name__ == "__main__":
    main()
