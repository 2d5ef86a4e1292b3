"""The ``fp8`` KV format's decode attention through FlashMLA's dense FP8 kernel on Hopper (optional).

FlashMLA (PyPI ``sgl-flash-mla``, SGLang's build: the ``flashmla`` extra) keeps DeepSeek's dense decode kernels
for sm90, among them one that reads the ``fp8`` format's rows as they are stored (576 e4m3 values a token, one
per-tensor scale, 64-token blocks) and multiplies in FP8 on the tensor cores: the queries are quantized to e4m3
with one scale a call, and the softmax's probabilities meet the latents in e4m3 too. It reads the cache faster
than our Triton kernel, which turns the rows into fp16 before its dots (benchmarks/flashmla_decode.py: 1.48x at
batch 64 x 8k on an H100, docs/benchmarks.md), at a larger error (the queries' and probabilities' roundings:
tests/gpu/test_mla_decode_flashmla.py).

``mla_decode`` hands a call here when ``usable`` says so: an sm90 GPU, the ``fp8`` format, 64-token blocks
(``block_size`` 64), bf16 queries of 512 + 64 values, no lse asked for, the package importable, and
``PDCLUSTER_FLASHMLA=1`` (``engine.envs``; off by default until measured in the engine on a GPU). Every step of it
runs on the device from shapes alone (the queries' scale, FlashMLA's split schedule from the rows' lengths), so
CUDA graphs capture it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from engine import envs
from engine.fp8 import FP8_DTYPE, FP8_MAX
from engine.fp8_kernels import sm90
from engine.kv_format import KVFormat

log = logging.getLogger(__name__)

PAGE = 64  # FlashMLA's block of tokens
LATENT, ROPE = 512, 64


@functools.cache
def _ops() -> Any:
    """FlashMLA's sm90 ("legacy") ops, or None (turned off, not installed, or its library does not load)."""
    if not envs.flashmla():
        return None
    try:
        from flash_mla._loader import get_ops

        return get_ops(True)
    except Exception as e:  # not installed, or its extension does not load here (CUDA, torch ABI)
        log.info("FlashMLA not used for fp8 KV decode: %s: %s", type(e).__name__, e)
        return None


def usable(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, kv_format: KVFormat | None,
           want_lse: bool) -> bool:
    """Whether ``decode`` serves this ``mla_decode`` call (see the module's docstring)."""
    return (kv_format is not None and kv_format.name == "fp8" and not want_lse and q_lat.is_cuda
            and q_lat.dtype == torch.bfloat16 and q_lat.shape[-1] == LATENT and q_pe.shape[-1] == ROPE
            and kv_cache.shape[1] == PAGE and sm90(q_lat.device.index or 0) and _ops() is not None)


def decode(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, scale: float, kv_format: KVFormat, out: torch.Tensor | None = None) -> torch.Tensor:
    """``mla_decode``'s output [B, H, L] (in ``out`` if given) for ``fp8`` rows: q [B, H, L + R] quantized to
    e4m3 by its largest magnitude, FlashMLA's schedule from ``seq_lens``, its FP8 kernel; rows of length 0 (a
    graph's padding) get zeros."""
    ops = _ops()
    b, h, _ = q_lat.shape
    q = torch.cat((q_lat, q_pe), dim=-1)  # [B, H, 576]
    q_scale = (q.abs().amax().float() / FP8_MAX).clamp_min(1e-12).reshape(1)
    q8 = (q.float() / q_scale).to(FP8_DTYPE).unsqueeze(1)  # [B, 1, H, 576]: one query token a row
    lens = seq_lens.to(torch.int32)
    meta, splits = ops.get_mla_decoding_metadata_dense_fp8(lens, h, 1)
    k_scale = torch.full((1,), kv_format.scale, dtype=torch.float32, device=q.device)
    got, _ = ops.fwd_kvcache_mla_fp8(q8, kv_cache.unsqueeze(2), LATENT, lens, block_tables.to(torch.int32), scale,
                                     False, meta, splits, q_scale, k_scale)
    got = torch.where((lens > 0).view(b, 1, 1), got.view(b, h, LATENT), 0.0)
    if out is None:
        return got.to(q_lat.dtype)
    out.copy_(got)
    return out
