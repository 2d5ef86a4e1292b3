"""The KV cache's row formats (``engine.kv_format``): DeepSeek's fp8_ds_mla byte layout, e4m3's error
bounds, and what a block costs in each."""

from __future__ import annotations

import pytest
import torch

from engine.fp8 import FP8_MAX
from engine.kv_cache import bytes_per_block
from engine.kv_format import KVFormat

L, R = 512, 64  # DeepSeek's latent and rope dims


def rows(n: int = 37, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, L + R, generator=g)
    x[:, :128] *= 10  # groups of different ranges: each gets its own scale
    x[3, 200] = 300.0
    return x


def test_row_sizes_are_the_stored_bytes() -> None:
    assert KVFormat("auto", L, R, torch.bfloat16).row_bytes == 1152
    assert KVFormat("auto", L, R, torch.float32).row_bytes == 2304
    assert KVFormat("fp8", L, R, torch.bfloat16).row_bytes == 576
    ds = KVFormat("fp8_ds_mla", L, R, torch.bfloat16)
    assert (ds.row_width, ds.row_bytes, ds.storage_dtype) == (656, 656, torch.uint8)  # FlashMLA's 656-byte row
    # A block of 16 tokens over 2 layers, as the cache sizing counts it.
    assert bytes_per_block(ds, 16, 2) == 2 * 16 * 656
    assert bytes_per_block(KVFormat("fp8", L, R, torch.float32), 16, 2) == 2 * 16 * 576


def test_fp8_ds_mla_rows_are_deepseeks_layout() -> None:
    """512 e4m3 values, 4 float32 scales (one per 128, amax / 448), 64 bf16 rope values, in that order."""
    x = rows()
    ds = KVFormat("fp8_ds_mla", L, R, torch.float32)
    stored = ds.encode(x)
    assert stored.shape == (x.shape[0], 656) and stored.dtype == torch.uint8
    scales = stored[:, 512:528].contiguous().view(torch.float32)
    want = x[:, :L].reshape(-1, 4, 128).abs().amax(-1) / FP8_MAX
    torch.testing.assert_close(scales, want, rtol=0, atol=0)
    rope = stored[:, 528:].contiguous().view(torch.bfloat16)
    assert torch.equal(rope, x[:, L:].to(torch.bfloat16))
    q = stored[:, :512].contiguous().view(torch.float8_e4m3fn).float().reshape(-1, 4, 128)
    assert q.abs().amax(-1).eq(FP8_MAX).all()  # each group's largest value maps to e4m3's largest
    back = ds.decode(stored)
    err = (back[:, :L] - x[:, :L]).abs().reshape(-1, 4, 128)
    # e4m3 keeps 3 mantissa bits: half an ulp is at most 1/16 of the value (1/8 of a scale step near 0).
    bound = torch.maximum(x[:, :L].abs().reshape(-1, 4, 128) / 16, want[..., None] * 2.0**-9)
    assert (err <= bound + 1e-6).all()
    torch.testing.assert_close(back[:, L:], x[:, L:].to(torch.bfloat16).float(), rtol=0, atol=0)


def test_fp8_rows_keep_e4m3_precision_and_saturate() -> None:
    x = rows()
    f = KVFormat("fp8", L, R, torch.float32)
    stored = f.encode(x)
    assert stored.dtype == torch.float8_e4m3fn and stored.shape == x.shape
    back = f.decode(stored)
    small = x.abs() <= FP8_MAX
    assert ((back - x).abs()[small] <= x.abs()[small] / 16 + 2.0**-10).all()
    assert back[3, 200] == 300.0 or abs(back[3, 200] - 300.0) <= 300.0 / 16
    assert KVFormat("fp8", L, R, torch.float32).decode(KVFormat("fp8", L, R, torch.float32).encode(
        torch.full((1, L + R), 1e6))).max() == FP8_MAX  # beyond ±448: saturated, never inf or NaN


def test_store_and_load_through_cache_slots() -> None:
    x = rows(8)
    for fmt in (KVFormat(n, L, R, torch.float32) for n in ("auto", "fp8", "fp8_ds_mla")):
        cache = torch.zeros(4, 16, fmt.row_width, dtype=fmt.storage_dtype).view(-1, fmt.row_width)
        slots = torch.tensor([63, 0, 17, 5, 40, 41, 2, 30])
        fmt.store(cache, slots, x)
        got = fmt.load(cache, slots.view(2, 4))
        assert got.shape == (2, 4, L + R) and got.dtype == torch.float32
        torch.testing.assert_close(got.view(8, -1), fmt.decode(fmt.encode(x)), rtol=0, atol=0)


def test_bad_formats_are_refused() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        KVFormat("int8", L, R, torch.float32)
    with pytest.raises(ValueError, match="divisible by 128"):
        KVFormat("fp8_ds_mla", 96, R, torch.float32)
    from engine.engine_config import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(model="m", kv_cache_dtype="fp8_e5m2")


def test_a_gpu_without_fp8_is_refused_with_its_name() -> None:
    fp8 = KVFormat("fp8_ds_mla", L, R, torch.bfloat16)
    with pytest.raises(ValueError, match=r"needs a GPU with FP8 .* has 8\.0"):
        fp8.check_device(torch.device("cuda", 0), capability=(8, 0))  # an A100
    fp8.check_device(torch.device("cuda", 0), capability=(9, 0))  # an H100 / H200
    fp8.check_device(torch.device("cpu"))
    KVFormat("auto", L, R, torch.bfloat16).check_device(torch.device("cuda", 0), capability=(7, 0))
