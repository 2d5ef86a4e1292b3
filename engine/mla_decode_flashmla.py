"""The ``fp8`` KV format's decode attention through FlashMLA's dense FP8 kernel on Hopper (optional).

FlashMLA (PyPI ``sgl-flash-mla``, SGLang's build: the ``flashmla`` extra) keeps DeepSeek's dense decode kernels
for sm90, among them one that reads the ``fp8`` format's rows as they are stored (576 e4m3 values a token, one
per-tensor scale, 64-token blocks) and multiplies in FP8 on the tensor cores: the queries are quantized to e4m3
with one scale a call, and the softmax's probabilities meet the latents in e4m3 too. It reads the cache faster
than our Triton kernel, which turns the rows into fp16 before its dots (benchmarks/flashmla_decode.py,
docs/benchmarks.md), at a larger error (the queries' and probabilities' roundings:
tests/gpu/test_mla_decode_flashmla.py), as vLLM's and SGLang's FP8 FlashMLA paths do.

``mla_decode`` hands a call here when ``usable`` says so: an sm90 GPU, the ``fp8`` format, 64-token blocks
(``block_size`` 64), bf16 queries of 512 + 64 values, no lse asked for, the package importable, and
``PDCLUSTER_FLASHMLA`` not 0 (``engine.envs``). Every step of it runs on the device from shapes alone, so CUDA
graphs capture it. Around FlashMLA's kernel: ``quantize_query`` (two Triton launches for the queries' e4m3 and
their one scale) in every layer, and ``_schedule`` (the int32 lengths and tables, FlashMLA's split schedule) once
a step, kept in the step's ``ForwardBatch.decode_memo``; done in every layer with torch's ops, the two cost a large
share of a long-context decode step (docs/benchmarks.md).
"""

# ruff: noqa: ANN001  (Triton kernel arguments are pointers and ints, typed by the JIT)
from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from engine import envs
from engine.forward_batch import StepMemo
from engine.fp8 import FP8_DTYPE, FP8_MAX
from engine.fp8_kernels import HAS_TRITON, sm90
from engine.kv_format import KVFormat

if HAS_TRITON:
    import triton
    import triton.language as tl

log = logging.getLogger(__name__)

PAGE = 64  # FlashMLA's block of tokens
LATENT, ROPE = 512, 64
AMAX_HEADS = 16  # heads a program of ``_amax`` takes: one atomic each (V3's 128 heads: 8 a row)


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


def _why_not(dtype: torch.dtype, lat: int, rope: int, page: int, device: torch.device) -> str | None:
    """Why FlashMLA's FP8 decode cannot serve fp8 rows of ``page``-token blocks for queries of ``dtype`` and
    ``lat`` + ``rope`` values on CUDA ``device``; None where it can."""
    if not sm90(device.index or 0):
        return "FlashMLA's FP8 decode needs sm90"
    if dtype != torch.bfloat16 or (lat, rope) != (LATENT, ROPE):
        return (f"FlashMLA's FP8 decode takes bf16 queries of {LATENT} + {ROPE}; this engine's are {dtype} of "
                f"{lat} + {rope}")
    if page != PAGE:
        return f"FlashMLA's FP8 decode needs block_size {PAGE}; this engine's is {page}"
    if _ops() is None:
        return "FlashMLA turned off by PDCLUSTER_FLASHMLA=0, or not installed: the flashmla extra"
    return None


def decode_kernel(kv_format: KVFormat, block_size: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """What will serve a one-process engine's decode attention over an ``fp8`` cache on ``device`` (``usable``'s
    conditions known at start-up), and why not FlashMLA where it is not, for the start-up log; None for other
    formats or off CUDA."""
    if kv_format.name != "fp8" or device.type != "cuda":
        return None
    why = _why_not(dtype, kv_format.lora, kv_format.rope, block_size, device)
    return "FlashMLA's FP8 kernel" if why is None else f"our Triton kernel ({why})"


def usable(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, kv_format: KVFormat | None,
           want_lse: bool) -> bool:
    """Whether ``decode`` serves this ``mla_decode`` call (see the module's docstring)."""
    return (kv_format is not None and kv_format.name == "fp8" and not want_lse and q_lat.is_cuda
            and _why_not(q_lat.dtype, q_lat.shape[-1], q_pe.shape[-1], kv_cache.shape[1], q_lat.device) is None)


if HAS_TRITON:

    @triton.jit
    def _amax(LAT, PE, AMAX, s_lb, s_lh, s_pb, s_ph, H, HC: tl.constexpr, L: tl.constexpr, R: tl.constexpr):
        # program (row b, chunk of HC heads): the largest magnitude of q_lat | q_pe there, into AMAX[0] (zeroed)
        b, heads = tl.program_id(0), tl.program_id(1) * HC + tl.arange(0, HC)
        hm = (heads < H)[:, None]
        lat = tl.load(LAT + b * s_lb + heads[:, None] * s_lh + tl.arange(0, L)[None, :], mask=hm, other=0.0)
        pe = tl.load(PE + b * s_pb + heads[:, None] * s_ph + tl.arange(0, R)[None, :], mask=hm, other=0.0)
        m_lat = tl.max(tl.max(tl.abs(lat.to(tl.float32)), 1), 0)
        tl.atomic_max(AMAX, tl.maximum(m_lat, tl.max(tl.max(tl.abs(pe.to(tl.float32)), 1), 0)))

    @triton.jit
    def _quantize(LAT, PE, AMAX, Q, QS, s_lb, s_lh, s_pb, s_ph, H, L: tl.constexpr, R: tl.constexpr):
        # program (b, h): q_lat[b, h] | q_pe[b, h] / scale in e4m3 into Q [B, H, L + R]; scale = amax / 448 into QS
        b, h = tl.program_id(0) // H, tl.program_id(0) % H
        # torch's arithmetic, so the bytes are its: amax / 448 as a product by 448's fp32 reciprocal (torch divides
        # by a Python number so), each value / scale an IEEE division (Triton's ``/`` on fp32 is an approximate one)
        s = tl.maximum(tl.load(AMAX), 1e-12) * (1.0 / 448.0)
        lat = tl.load(LAT + b * s_lb + h * s_lh + tl.arange(0, L)).to(tl.float32)
        pe = tl.load(PE + b * s_pb + h * s_ph + tl.arange(0, R)).to(tl.float32)
        row = Q + (b * H + h) * (L + R)
        tl.store(row + tl.arange(0, L), tl.clamp(tl.div_rn(lat, s), -448.0, 448.0).to(Q.dtype.element_ty))
        tl.store(row + L + tl.arange(0, R), tl.clamp(tl.div_rn(pe, s), -448.0, 448.0).to(Q.dtype.element_ty))
        if tl.program_id(0) == 0:
            tl.store(QS, s)


def quantize_query(q_lat: torch.Tensor, q_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q_lat [B, H, L] | q_pe [B, H, R] -> (e4m3 [B, 1, H, L + R], fp32 scale [1]) by the largest magnitude of
    both: three launches (a zeroed max, the max, the quantization)."""
    b, h, lat = q_lat.shape
    rope = q_pe.shape[-1]
    if not HAS_TRITON or not q_lat.is_cuda or q_lat.stride(-1) != 1 or q_pe.stride(-1) != 1:
        q = torch.cat((q_lat, q_pe), dim=-1).float()
        scale = (q.abs().amax() / FP8_MAX).clamp_min(1e-12).reshape(1)
        return (q / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).unsqueeze(1), scale
    amax = torch.zeros(1, dtype=torch.float32, device=q_lat.device)
    q8 = torch.empty(b, 1, h, lat + rope, dtype=FP8_DTYPE, device=q_lat.device)
    scale = torch.empty(1, dtype=torch.float32, device=q_lat.device)
    strides = (q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1))
    _amax[(b, triton.cdiv(h, AMAX_HEADS))](q_lat, q_pe, amax, *strides, h, HC=AMAX_HEADS, L=lat, R=rope)
    _quantize[(b * h,)](q_lat, q_pe, amax, q8, scale, *strides, h, L=lat, R=rope)
    return q8, scale


def _schedule(seq_lens: torch.Tensor, block_tables: torch.Tensor, heads: int, kv_scale: float,
              memo: StepMemo | None) -> tuple[torch.Tensor, ...]:
    """What every layer's call of one step shares: the rows' lengths and tables as int32, FlashMLA's split
    schedule for them, the cache's scale, which rows are live. Made by the step's first call and kept in ``memo``
    (the step's ``ForwardBatch.decode_memo``; a graph's capture has a batch of its own, so its replay computes
    them once), under the very ``seq_lens`` and ``block_tables`` tensors."""

    def make() -> tuple[torch.Tensor, ...]:
        # A row of length 0 (a graph's padding; every row while a graph is captured) is read as one token of its
        # table's first block and its output zeroed after: FlashMLA faults on a batch whose rows are all empty.
        lens = seq_lens.clamp_min(1).to(torch.int32)
        meta, splits = _ops().get_mla_decoding_metadata_dense_fp8(lens, heads, 1)
        k_scale = torch.full((1,), kv_scale, dtype=torch.float32, device=seq_lens.device)
        return lens, block_tables.to(torch.int32), meta, splits, k_scale, seq_lens > 0

    return make() if memo is None else memo.get((seq_lens, block_tables), (__name__, heads, kv_scale), make)


def decode(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, scale: float, kv_format: KVFormat, out: torch.Tensor | None = None,
           memo: StepMemo | None = None) -> torch.Tensor:
    """``mla_decode``'s output [B, H, L] (in ``out`` if given) for ``fp8`` rows: q [B, H, L + R] quantized to
    e4m3 by its largest magnitude, FlashMLA's schedule from ``seq_lens`` (once a step: ``_schedule``), its FP8
    kernel; rows of length 0 (a graph's padding) get zeros."""
    b, h, _ = q_lat.shape
    q8, q_scale = quantize_query(q_lat, q_pe)
    lens, tables, meta, splits, k_scale, live = _schedule(seq_lens, block_tables, h, kv_format.scale, memo)
    got, _ = _ops().fwd_kvcache_mla_fp8(q8, kv_cache.unsqueeze(2), LATENT, lens, tables, scale, False, meta, splits,
                                        q_scale, k_scale)
    got = torch.where(live.view(b, 1, 1), got.view(b, h, LATENT), 0.0)
    if out is None:
        return got.to(q_lat.dtype)
    out.copy_(got)
    return out
