"""Block FP8 in DeepSeek's checkpoint format (DeepSeek-V3/R1/V3.1, Kimi-K2, GLM's FP8 releases).

A quantized linear's weight ``W [N, K]`` is stored as ``float8_e4m3fn`` with a float32
``weight_scale_inv [ceil(N/128), ceil(K/128)]`` beside it: one scale per 128 x 128 block, the factor
that takes the block back (``W ≈ W_fp8 * scale_inv``; edge blocks of a shape that is not a multiple of
128 are padded for the scale, and the padding is not stored). Activations are quantized per token in
groups of 128 channels at run time (``activation_scheme: dynamic``). V3.1 stores power-of-two scales
(``scale_fmt: ue8m0``). ``config.json`` says so in its ``quantization_config``::

    {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}

``Fp8Config.from_dict`` reads it (and refuses, naming it, any quantization this engine does not run);
``quantize_blocks`` is our quantizer into that format (``pdctl make-model --quantize fp8``) and
``dequantize_blocks`` its inverse, which the loader applies where the weights are computed in the
model's dtype (today everywhere: CPU and GPU alike dequantize at load).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"  # "x.weight" -> "x.weight_scale_inv"
# The weights DeepSeek's checkpoints quantize: every linear of the decoder layers (attention's projections,
# dense MLPs, routed and shared experts) but the router's gate; embeddings, norms and the LM head stay.
_QUANTIZED = re.compile(r"^model\.layers\.\d+\."
                        r"(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
                        r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate_proj|up_proj|down_proj))\.weight$")
# The smallest amax a block is scaled for (an all-zero block would divide by zero), as DeepSeek's kernels do.
_MIN_AMAX = 1e-4


@dataclass(frozen=True)
class Fp8Config:
    """A checkpoint's block-FP8 quantization: the block shape and whether scales are powers of two."""

    block: tuple[int, int] = BLOCK
    ue8m0: bool = False

    def __post_init__(self) -> None:
        if self.block != BLOCK:
            raise ValueError(f"FP8 weight_block_size {list(self.block)} is not supported (only {list(BLOCK)}, "
                             "DeepSeek's)")

    @classmethod
    def from_dict(cls, qc: dict[str, Any]) -> Fp8Config:
        """``config.json``'s ``quantization_config``; ValueError naming what is not supported."""
        method = qc.get("quant_method")
        if method != "fp8":
            raise ValueError(f"quantization method {method!r} is not supported by the native engine (supported: "
                             "'fp8', DeepSeek's block format: e4m3, weight_block_size [128, 128], dynamic activations)")
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"FP8 format {fmt!r} is not supported (only e4m3)")
        act = qc.get("activation_scheme", "dynamic")
        if act != "dynamic":
            raise ValueError(f"FP8 activation_scheme {act!r} is not supported (only dynamic)")
        block = qc.get("weight_block_size")
        if block is None:
            raise ValueError("FP8 without weight_block_size (per-tensor FP8) is not supported: only [128, 128] blocks")
        if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) for b in block)):
            raise ValueError(f"FP8 weight_block_size must be two integers, got {block!r}")
        scale_fmt = qc.get("scale_fmt")
        if scale_fmt not in (None, "ue8m0"):
            raise ValueError(f"FP8 scale_fmt {scale_fmt!r} is not supported (none, or ue8m0)")
        return cls(block=(block[0], block[1]), ue8m0=scale_fmt == "ue8m0")

    def to_dict(self) -> dict[str, Any]:
        """The ``quantization_config`` a checkpoint in this format carries."""
        out: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(self.block),
                               "activation_scheme": "dynamic"}
        if self.ue8m0:
            out["scale_fmt"] = "ue8m0"
        return out


def is_quantized_linear(name: str) -> bool:
    """Whether DeepSeek's FP8 checkpoints store the tensor ``name`` (Hub names) in FP8."""
    return _QUANTIZED.match(name) is not None


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    """The ``weight_scale_inv`` shape of a weight ``[N, K]``: one entry per (padded) block."""
    n, k = shape
    return math.ceil(n / block[0]), math.ceil(k / block[1])


def quantize_blocks(w: torch.Tensor, block: tuple[int, int] = BLOCK,
                    ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> (``float8_e4m3fn [N, K]``, float32 ``scale_inv [ceil(N/bn), ceil(K/bk)]``): each block
    scaled so its largest magnitude maps to e4m3's 448 (with ``ue8m0``, the scale rounded up to a power of
    two, so nothing saturates)."""
    if w.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights, got shape {tuple(w.shape)}")
    n, k = w.shape
    sn, sk = scale_shape((n, k), block)
    bn, bk = block
    padded = torch.zeros(sn * bn, sk * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    blocks = padded.view(sn, bn, sk, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=_MIN_AMAX)  # [sn, sk]
    scale_inv = amax / FP8_MAX
    if ue8m0:
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(sn * bn, sk * bk)[:n, :k].contiguous(), scale_inv.contiguous()


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK,
                      dtype: torch.dtype = torch.float32, name: str = "weight") -> torch.Tensor:
    """``q * scale_inv`` block by block, in ``dtype``; ValueError for a scale of the wrong shape or with
    values that cannot be a scale (not finite, not positive), naming the tensor."""
    if q.dim() != 2:
        raise ValueError(f"tensor {name!r}: an FP8 weight must be 2-D, got shape {tuple(q.shape)}")
    want = scale_shape(tuple(q.shape), block)
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"tensor {name!r}{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}; a {tuple(q.shape)} "
                         f"weight in {list(block)} blocks needs {want}")
    s = scale_inv.float()
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise ValueError(f"tensor {name!r}{SCALE_SUFFIX} holds scales that are not finite and positive")
    n, k = q.shape
    full = s.repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]
    return (q.float() * full).to(dtype)
