"""Block-FP8 dense linears at prefill sizes through DeepGEMM's FP8 GEMM (Hopper; optional).

A block-FP8 checkpoint's attention projections and dense MLPs run in bf16 on cuBLAS (``engine.fp8_compute``
says why: at decode sizes they are bound by latency, and bf16 is fastest there). At prefill sizes they are
bound by compute, and DeepGEMM's ``fp8_gemm_nt`` (1 x 128 activation groups against the checkpoint's 128 x 128
weight blocks) runs the same product at FP8's rate. So where the ``deepgemm`` extra's library loads on an sm90
GPU, ``hold_fp8_copies`` gives each such linear an FP8 copy of its weight beside the bf16 one
(``PrefillFp8Linear``), and a step of at least ``MIN_ROWS`` rows multiplies through it: its input quantized per
token (``fp8_kernels.quantize_groups``, scales in the layout DeepGEMM reads), then one DeepGEMM call. Smaller
steps (decode, CUDA graphs) keep cuBLAS bf16.

The copy is quantized from the loaded bf16 weight, which holds the checkpoint's values: each block's e4m3
values times its scale, rounded to bf16 (2^-9 of a value at most, far under e4m3's spacing of 2^-4), so
quantizing again gives the checkpoint's e4m3 bytes and its scales to within that rounding, from real and dummy
weights alike. ``kv_a_proj_with_mqa`` stays bf16: its 576 output columns are too few for FP8 to pay
(docs/benchmarks.md). Linears whose dimensions are not whole 128-blocks keep bf16 too.

Which path a step takes depends on its rows, so a prompt prefilled in one step of 4,096+ rows and the same
prompt prefilled in smaller chunks (or over PCP ranks with fewer rows each) differ within FP8's error from the
second layer's latents on (the first layer's come from the embeddings through bf16 ``kv_a``): tests that compare
KV bytes across topologies keep their prompts under ``MIN_ROWS``, or turn this off.

On unless ``PDCLUSTER_DENSE_DEEP_GEMM=0`` (``engine.envs``; ``PDCLUSTER_DEEP_GEMM=0`` turns it off with DeepGEMM's
experts), and only in an engine whose steps can reach ``MIN_ROWS`` rows (``executor.step_rows``: its
``max_num_batched_tokens``, a PCP rank's share of it; the default budget of 2,048 holds no copy). The copies cost
memory the KV cache would otherwise get: half the bf16 weights of those linears again, ~0.34 GB for V2-Lite and
~12 GB for V3 on each rank that holds its whole attention. On an H100 its products match the same arithmetic in fp32
(tests/gpu/test_dense_deep_gemm.py) and are 1.1-1.4x bf16 on V2-Lite's shapes and 1.4-1.7x on V3's at 4k-16k rows;
with each input's quantization a V3-shaped prefill (4 layers, 4k and 16k tokens) is 1.2x faster and a 16k V2-Lite
one under 1% (docs/benchmarks.md, thirteenth and fourteenth sessions). A DeepGEMM failure (its compile, a check of
its inputs) is logged once and the linears go back to bf16; at the warm-up before serving, their copies are released
too (``release_copies``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine import envs, moe_deep_gemm
from engine.fp8 import BLOCK, is_quantized_linear, quantize_blocks
from engine.fp8_kernels import GROUP, HAS_TRITON, quantize_groups, sm90

log = logging.getLogger(__name__)

# Rows from which a step's linears take the FP8 copy (prefill chunks; decode steps and graphs stay below). From
# 4,096 every eligible V2-Lite and V3 shape was faster than bf16 on an H100; at 2,048 rows DeepGEMM's kernel for
# some shapes was 0.35-0.48x bf16 (benchmarks/fp8_gemm.py, docs/benchmarks.md thirteenth session).
MIN_ROWS = 4096
_KEPT_BF16 = ("kv_a_proj_with_mqa",)
_state = {"failed": False}


class PrefillFp8Linear(nn.Linear):
    """``nn.Linear`` (sharing the original's bf16 weight) that also holds a block-FP8 copy of it: inputs of at
    least ``MIN_ROWS`` rows multiply through DeepGEMM, smaller ones through ``F.linear``."""

    def __init__(self, linear: nn.Linear, w8: torch.Tensor, w_scale: torch.Tensor) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.weight = linear.weight
        self.w8, self.w_scale = w8, w_scale  # plain attributes: not parameters the loader fills

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] >= MIN_ROWS and not _state["failed"]:
            y = linear(x, self.w8, self.w_scale)
            if y is not None:
                return y
        return F.linear(x, self.weight)


def _eligible(name: str, mod: nn.Module) -> bool:
    return (type(mod) is nn.Linear and mod.bias is None and not name.endswith(_KEPT_BF16)
            and is_quantized_linear(f"{name}.weight") and mod.weight.dtype == torch.bfloat16
            and mod.in_features % GROUP == 0 and mod.out_features % GROUP == 0)


def usable(device: torch.device) -> bool:
    """Whether a block-FP8 model on ``device`` gets FP8 copies: sm90 with DeepGEMM's library."""
    return (HAS_TRITON and device.type == "cuda" and envs.dense_deep_gemm() and sm90(device.index or 0)
            and moe_deep_gemm.library() is not None)


def hold_fp8_copies(model: nn.Module, ue8m0: bool = False, max_rows: int = MIN_ROWS) -> int:
    """Swap each of a loaded block-FP8 ``model``'s eligible linears (module docstring) for a
    ``PrefillFp8Linear`` holding an FP8 copy of its weight (``ue8m0``: power-of-two scales, as the checkpoint's).
    ``max_rows``: the most rows a step of this engine can have; under ``MIN_ROWS`` no step would take a copy, so
    none is held (an engine whose batch budget is small, as a decode node's may be, keeps that memory for KV).
    Returns how many were given one (0 where ``usable`` says no)."""
    device = next(model.parameters()).device
    if max_rows < MIN_ROWS or not usable(device):
        return 0
    swaps = [(name, mod) for name, mod in model.named_modules() if _eligible(name, mod)]
    for name, mod in swaps:
        w8, w_scale = quantize_blocks(mod.weight.detach(), BLOCK, ue8m0)
        _replace(model, name, PrefillFp8Linear(mod, w8, w_scale))
    return len(swaps)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, new)


def linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor | None:
    """bf16 ``x`` [M, K] times the block-FP8 weight ``w8`` [N, K] (``w_scale`` [N/128, K/128]) transposed ->
    [M, N] bf16 through DeepGEMM; None if DeepGEMM failed (logged; the caller multiplies in bf16)."""
    dg: Any = moe_deep_gemm.library()
    xq, xs = quantize_groups(x if x.stride(-1) == 1 else x.contiguous(), mn_major=True)
    y = torch.empty(x.shape[0], w8.shape[0], dtype=torch.bfloat16, device=x.device)
    try:
        dg.fp8_gemm_nt((xq, xs), (w8, w_scale), y)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as err:  # its kernel's compile (NVCC at $CUDA_HOME) or a check of its inputs
        _state["failed"] = True
        log.warning("DeepGEMM failed; the FP8 dense linears go back to bf16: %s", str(err)[:500])
        return None
    return y


def warm_up(model: nn.Module, max_rows: int) -> int:
    """Compile DeepGEMM's kernels for each FP8 copy's shape before serving, at each doubling of the rows from
    ``MIN_ROWS`` up to ``max_rows`` (DeepGEMM picks its kernel by the rows), as ``moe_deep_gemm.warm_up`` does
    for the experts. Returns the products run (0 where no linear holds a copy)."""
    shapes = {(m.in_features, m.w8.shape[0]): m for m in model.modules() if isinstance(m, PrefillFp8Linear)}
    if not shapes or max_rows < MIN_ROWS:
        return 0
    rows = moe_deep_gemm.doublings(MIN_ROWS, max_rows)
    device = next(iter(shapes.values())).weight.device
    for (k, _), m in shapes.items():
        x = torch.zeros(max_rows, k, dtype=torch.bfloat16, device=device)
        for r in rows:
            m(x[:r])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if _state["failed"]:  # no step will take a copy: their memory goes to the KV cache, allocated next
        log.warning("released the FP8 copies of %d dense linears", release_copies(model))
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the warm-up's buffers (and any released copies) back to the device
    return 0 if _state["failed"] else len(shapes) * len(rows)


def release_copies(model: nn.Module) -> int:
    """Swap each ``PrefillFp8Linear`` of ``model`` back for a plain ``nn.Linear`` on the same bf16 weight, dropping
    its FP8 copy (after DeepGEMM failed at warm-up: no step would use it). Returns how many were swapped."""
    swaps = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, PrefillFp8Linear)]
    for name, mod in swaps:
        plain = nn.Linear(mod.in_features, mod.out_features, bias=False, device="meta")
        plain.weight = mod.weight
        _replace(model, name, plain)
    return len(swaps)
