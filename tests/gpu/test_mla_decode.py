"""The Triton MLA decode kernel (engine/mla_decode.py) against its fp32 torch reference, and in a CUDA graph.

Tolerance (bf16): the kernel rounds the softmax weights p to bf16 before p @ kv_c (relative error <= 2^-8
per weight) and, with one split, the output to bf16 (2^-8 of |out|); scores and sums stay fp32. So
|out - ref| <= ~2^-8 * (max |kv_c| + |out|) <= 2^-7 * max|kv_c|; we allow 2^-6 * max|kv_c| (2x margin).
The LSE comes from fp32 dot products of the same bf16 values (exact products): 1e-3 absolute.
For fp32 inputs (the interpreter run) the dots are IEEE fp32: 1e-4 relative to max|kv_c|, lse 1e-4.

The checks are plain functions of a device, so they also run under Triton's interpreter on CPU:

  TRITON_INTERPRET=1 python tests/gpu/test_mla_decode.py     # small shapes, fp32 and fp16
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import engine.mla_decode as mla_decode_module  # noqa: E402
from engine.kv_format import KVFormat  # noqa: E402
from engine.mla_decode import (  # noqa: E402
    HAS_TRITON,
    choose_num_splits,
    group_rows,
    mla_decode,
    mla_decode_reference,
    workspace_for,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_TRITON, reason="needs triton")]

L, R = 512, 64
SCALE = 192**-0.5  # DeepSeek's qk_head_dim 128 + 64 (yarn's mscale left out: any scale will do)
TOL = {torch.bfloat16: (2.0**-6, 1e-3), torch.float16: (2.0**-8, 1e-3), torch.float32: (1e-4, 1e-4)}


def make_case(lens: list[int], heads: int, page: int, dtype: torch.dtype, device: str, seed: int = 0,
              width: int | None = None, lat: int = L, rope: int = R, q_gain: float = 1.0) -> dict:
    """A paged cache holding each row's tokens in shuffled, non-contiguous blocks (plus spare blocks of
    noise), block tables padded with 0 to ``width`` (default: the longest row's), q [B, H, L] / [B, H, R]."""
    g = torch.Generator().manual_seed(seed)
    need = [(n + page - 1) // page for n in lens]
    num_blocks = sum(need) + 3
    width = width or max(max(need), 1)
    cache = torch.randn(num_blocks, page, lat + rope, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    used = 0
    for i, k in enumerate(need):
        tables[i, :k] = perm[used : used + k]
        used += k
    q_lat = (torch.randn(len(lens), heads, lat, generator=g) * q_gain).to(dtype)
    q_pe = (torch.randn(len(lens), heads, rope, generator=g) * q_gain).to(dtype)
    return {k: v.to(device) for k, v in dict(q_lat=q_lat, q_pe=q_pe, kv_cache=cache, block_tables=tables,
                                              seq_lens=torch.tensor(lens, dtype=torch.long)).items()}


def quantized_case(name: str, lens: list[int], heads: int, page: int, dtype: torch.dtype, device: str,
                   seed: int = 0, lat: int = L, rope: int = R) -> tuple[dict, KVFormat]:
    """``make_case``'s cache stored in the KV format ``name`` (engine.kv_format), q in ``dtype``."""
    case = make_case(lens, heads, page, torch.float32, "cpu", seed=seed, lat=lat, rope=rope)
    fmt = KVFormat(name, lat, rope, dtype)
    nb, pg, w = case["kv_cache"].shape
    case["kv_cache"] = fmt.encode(case["kv_cache"].view(-1, w)).view(nb, pg, fmt.row_width)
    case["q_lat"], case["q_pe"] = case["q_lat"].to(dtype), case["q_pe"].to(dtype)
    return {k: v.to(device) for k, v in case.items()}, fmt


def check(case: dict, want_lse: bool, num_splits: int | None = None, label: str = "",
          kv_format: KVFormat | None = None) -> tuple[float, float]:
    """Kernel vs reference on one case; returns (max out error / max|kv_c|, max lse error). A quantized
    cache is compared with the reference over its decoded rows (the kernel dequantizes tiles into q's
    dtype, as the reference's decode does: the bf16 budget applies)."""
    dtype = case["kv_cache"].dtype if kv_format is None else case["q_lat"].dtype
    lat = case["q_lat"].shape[-1]
    out, lse = mla_decode(**case, scale=SCALE, want_lse=want_lse, num_splits=num_splits, kv_format=kv_format)
    ref, ref_lse = mla_decode_reference(**case, scale=SCALE, want_lse=True, kv_format=kv_format)
    assert out.shape == ref.shape and out.dtype == case["q_lat"].dtype, (label, out.shape, out.dtype)
    assert torch.isfinite(out).all(), f"{label}: non-finite output"
    rows = case["kv_cache"] if kv_format is None else kv_format.decode(case["kv_cache"])
    vmax = float(rows[..., :lat].float().abs().max())
    err = float((out.float() - ref).abs().max()) / vmax
    tol, lse_tol = TOL[dtype]
    assert err <= tol, f"{label}: max |out - ref| / max|kv_c| = {err:.3g} > {tol:.3g}"
    lse_err = 0.0
    if want_lse:
        assert lse is not None and lse.dtype == torch.float32
        empty = case["seq_lens"] == 0
        assert torch.isneginf(lse[empty]).all(), f"{label}: seq_len-0 rows must have lse -inf"
        lse_err = float((lse[~empty] - ref_lse[~empty]).abs().max()) if (~empty).any() else 0.0
        assert lse_err <= lse_tol, f"{label}: max |lse - ref| = {lse_err:.3g} > {lse_tol:.3g}"
    else:
        assert lse is None
    assert (out[case["seq_lens"] == 0] == 0).all(), f"{label}: seq_len-0 rows must be zeros"
    return err, lse_err


def ragged_lens(batch: int, max_len: int, page: int, seed: int) -> list[int]:
    """Random lengths in [1, max_len]; the first rows are max_len, 1, 0 (graph padding) and a page's edges."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (batch,), generator=g).tolist()
    edges = [max_len, 1, 0, page - 1, page, page + 1]
    return [min(e, max_len) for e in edges[:batch]] + lens[len(edges):]


def run_checks(device: str, dtype: torch.dtype, configs: list[tuple], lat: int = L, rope: int = R) -> list[str]:
    """configs: (heads, page, batch, max_len, num_splits or None); every case with and without lse."""
    lines = []
    for k, (heads, page, batch, max_len, splits) in enumerate(configs):
        lens = ragged_lens(batch, max_len, page, seed=k)
        case = make_case(lens, heads, page, dtype, device, seed=k, lat=lat, rope=rope)
        for want_lse in (False, True):
            label = f"H={heads} page={page} B={batch} max_len={max_len} splits={splits} lse={want_lse} {dtype}"
            err, lse_err = check(case, want_lse, splits, label)
            lines.append(f"{label}: out err {err:.2e} (of max|kv_c|), lse err {lse_err:.2e}")
    return lines


def check_graph(device: str = "cuda", dtype: torch.dtype = torch.bfloat16, heads: int = 16, page: int = 16,
                batch: int = 8, width: int = 2048) -> None:
    """Capture once with static buffers, replay with new lens / tables / q / cache contents, check each replay."""
    splits = choose_num_splits(batch, heads, width * page, torch.device(device))
    static = make_case([width * page] * batch, heads, page, dtype, device, seed=100, width=width)  # all blocks
    out = torch.empty(batch, heads, L, dtype=dtype, device=device)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=device)
    ws = workspace_for(batch, heads, L, splits, device)

    def call() -> None:
        mla_decode(**static, scale=SCALE, out=out, lse=lse, workspace=ws, num_splits=splits)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    tol, lse_tol = TOL[dtype]
    for seed, max_len in ((1, 300), (2, width * page), (3, 40)):
        new = make_case(ragged_lens(batch, max_len, page, seed), heads, page, dtype, device, seed=seed, width=width)
        for k in ("q_lat", "q_pe", "block_tables", "seq_lens"):
            static[k].copy_(new[k])
        static["kv_cache"][: new["kv_cache"].shape[0]].copy_(new["kv_cache"])
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_lse = mla_decode_reference(**static, scale=SCALE, want_lse=True)
        vmax = float(new["kv_cache"][..., :L].float().abs().max())
        err = float((out.float() - ref).abs().max()) / vmax
        assert err <= tol, f"graph replay {seed}: max |out - ref| / max|kv_c| = {err:.3g} > {tol:.3g}"
        live = static["seq_lens"] > 0
        assert torch.isneginf(lse[~live]).all() and (out[~live] == 0).all(), f"graph replay {seed}: padding rows"
        lse_err = float((lse[live] - ref_lse[live]).abs().max())
        assert lse_err <= lse_tol, f"graph replay {seed}: max |lse - ref| = {lse_err:.3g} > {lse_tol:.3g}"


def check_grouped(device: str, dtype: torch.dtype, heads: int = 16, page: int = 16, decode: int = 5,
                  segments: tuple[tuple[int, int], ...] = ((300, 37), (0, 9), (1000, 70)), pad: int = 6,
                  lat: int = L, rope: int = R, num_splits: int | None = None) -> None:
    """Decode rows, then prefill segments (context, new rows) whose rows share a block table and attend
    up to their own positions, then padding rows: with the aligned groups flagged, against the reference."""
    g = group_rows(heads)
    lens = ragged_lens(decode, 700, page, seed=3)
    starts = []
    for ctx, n in segments:
        starts.append(len(lens))
        lens += [ctx + n] * n  # each row gets blocks for the whole segment; the first row's table is shared
    lens += [0] * pad
    case = make_case(lens, heads, page, dtype, device, seed=11, lat=lat, rope=rope)
    flags = torch.zeros(len(lens), dtype=torch.int32)
    for (ctx, n), s0 in zip(segments, starts):
        case["block_tables"][s0 : s0 + n] = case["block_tables"][s0]
        case["seq_lens"][s0 : s0 + n] = torch.arange(ctx + 1, ctx + n + 1)
        first = -(-s0 // g) * g
        for r in range(first, s0 + n - g + 1, g):
            flags[r : r + g] = 1
    assert flags.any(), "the case must have groups"
    flags = flags.to(device)
    ref, ref_lse = mla_decode_reference(**case, scale=SCALE, want_lse=True)
    out, lse = mla_decode(**case, scale=SCALE, want_lse=True, grouped=flags, num_splits=num_splits)
    assert lse is not None
    vmax = float(case["kv_cache"][..., :lat].float().abs().max())
    tol, lse_tol = TOL[dtype]
    err = float((out.float() - ref).abs().max()) / vmax
    assert err <= tol, f"grouped H={heads}: max |out - ref| / max|kv_c| = {err:.3g} > {tol:.3g}"
    live = case["seq_lens"] > 0
    assert torch.isneginf(lse[~live]).all() and (out[~live] == 0).all(), "padding rows"
    lse_err = float((lse[live] - ref_lse[live]).abs().max())
    assert lse_err <= lse_tol, f"grouped H={heads}: max |lse - ref| = {lse_err:.3g} > {lse_tol:.3g}"


# -- pytest (CUDA) ------------------------------------------------------------------------------------------

GPU_CONFIGS = [  # (heads, page, batch, max_len, num_splits)
    (16, 16, 1, 1, None), (16, 16, 1, 32768, None), (16, 64, 1, 32768, None),
    (16, 16, 8, 4096, None), (16, 64, 8, 4096, 1), (16, 16, 64, 32768, None), (16, 64, 64, 2000, 5),
    (128, 16, 1, 32768, None), (128, 64, 4, 32768, None), (128, 16, 64, 8192, None), (128, 64, 33, 32768, 1),
    (16, 16, 256, 1024, None),
]


@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda c: "H{}-page{}-B{}-len{}-splits{}".format(*c))
def test_kernel_matches_reference(config: tuple) -> None:
    for line in run_checks("cuda", torch.bfloat16, [config]):
        print(line)


def test_large_scores_stay_finite() -> None:
    """q 30x larger: scores in the hundreds, softmax nearly one-hot; the online max keeps it exact."""
    case = make_case(ragged_lens(16, 5000, 16, 7), 16, 16, torch.bfloat16, "cuda", seed=7, q_gain=30.0)
    check(case, want_lse=True, label="large scores")


def run_quantized(device: str, dtype: torch.dtype, configs: list[tuple], lat: int = L, rope: int = R) -> list[str]:
    """``run_checks`` over caches in each FP8 format."""
    lines = []
    for name in ("fp8", "fp8_ds_mla"):
        for k, (heads, page, batch, max_len, splits) in enumerate(configs):
            case, fmt = quantized_case(name, ragged_lens(batch, max_len, page, seed=k), heads, page, dtype, device,
                                       seed=k, lat=lat, rope=rope)
            label = f"{name} H={heads} page={page} B={batch} max_len={max_len} splits={splits} {dtype}"
            err, lse_err = check(case, True, splits, label, kv_format=fmt)
            check(case, False, splits, label, kv_format=fmt)
            lines.append(f"{label}: out err {err:.2e} (of max|kv_c|), lse err {lse_err:.2e}")
    return lines


@pytest.mark.parametrize("config", GPU_CONFIGS[1::2], ids=lambda c: "H{}-page{}-B{}-len{}-splits{}".format(*c))
def test_fp8_caches_match_reference(config: tuple) -> None:
    for line in run_quantized("cuda", torch.bfloat16, [config]):
        print(line)


@pytest.mark.parametrize("convert", ["compiler", "bits", "ptx", "ptx-plain"])
def test_fp8_conversions_match_reference(convert: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each way the kernel turns e4m3 rows into fp16 (mla_decode.FP8_CONVERT; "ptx" the default on GPUs);
    "ptx-plain": without the opaque identity (mla_decode.OPAQUE_TILES) that "ptx" passes its tiles through."""
    monkeypatch.setattr(mla_decode_module, "FP8_CONVERT", convert.removesuffix("-plain"))
    monkeypatch.setattr(mla_decode_module, "OPAQUE_TILES", not convert.endswith("-plain"))
    for line in run_quantized("cuda", torch.bfloat16, [GPU_CONFIGS[1]]):
        print(convert, line)


def test_fp32_cache_on_gpu() -> None:
    run_checks("cuda", torch.float32, [(16, 16, 8, 3000, None), (128, 64, 3, 3000, 4)])


def test_cuda_graph_replay_with_new_lens_and_tables() -> None:
    check_graph("cuda", torch.bfloat16, heads=16, page=16, batch=8, width=2048)
    check_graph("cuda", torch.bfloat16, heads=128, page=64, batch=4, width=512)


@pytest.mark.parametrize("heads,page,splits", [(16, 16, None), (16, 64, 1), (32, 16, 3), (128, 64, None)])
def test_grouped_rows_match_reference(heads: int, page: int, splits: int | None) -> None:
    """One request's rows served in groups (a short prefill in a graph), beside decode rows and padding."""
    check_grouped("cuda", torch.bfloat16, heads=heads, page=page, num_splits=splits)
    check_grouped("cuda", torch.bfloat16, heads=heads, page=page, segments=((5000, 200),), decode=0, pad=0)


def test_splits_are_static() -> None:
    dev = torch.device("cuda")
    assert choose_num_splits(1, 16, 32768, dev) >= 32  # one row of long context is spread over the SMs
    assert choose_num_splits(1, 16, 512, dev) <= 8  # ... but a split holds at least MIN_SPLIT_TOKENS
    assert choose_num_splits(256, 128, 32768, dev) == 1


if __name__ == "__main__":  # TRITON_INTERPRET=1: the same checks on CPU, small shapes
    interp = [(16, 16, 3, 70, None), (16, 16, 4, 100, 1), (16, 64, 3, 200, 3), (20, 16, 3, 90, 4), (32, 64, 2, 150, 2)]
    for dt in (torch.float32, torch.float16):
        for line in run_checks("cpu", dt, interp, lat=64, rope=16):
            print(line)
    for line in run_checks("cpu", torch.float32, [(16, 16, 2, 40, 2), (16, 16, 3, 700, 64)]):  # the real L, R
        print(line)
    for dt in (torch.float32, torch.float16):
        check_grouped("cpu", dt, lat=64, rope=16, segments=((30, 13), (0, 9)), decode=3, pad=2)
        check_grouped("cpu", dt, lat=64, rope=16, segments=((40, 11),), decode=0, pad=0, num_splits=2)
    print("grouped ok")
    for convert in ("bits", "compiler"):  # the interpreter runs no PTX (mla_decode.FP8_CONVERT)
        mla_decode_module.FP8_CONVERT = convert
        for dt in (torch.float32, torch.float16):  # fp16 queries: the fp8 format's fp16 dots (mla_decode.FP8_DOTS)
            # the last case's one split of 300 tokens takes the 8-bit rows' 64-token tiles (mla_decode._tiles)
            for line in run_quantized("cpu", dt, [(16, 16, 3, 70, None), (16, 16, 2, 90, 2), (16, 16, 2, 300, 1)]):
                print(convert, line)
    print("ok")
