"""Where a block-FP8 checkpoint computes in FP8: the routed experts and the shared experts, on CUDA (W8A8
fused kernels, ``engine.moe_kernels``; per-token 1 x 128 activation groups, the checkpoint's 128 x 128 weight
blocks).

``use_fp8_compute(model)`` turns a freshly built (meta) model's MoE layers into that form: the stacked
experts in e4m3 with their scale stacks, the shared experts as more slots of the stack (``MoE.hold_fp8``), so
the loader copies the stored bytes. Every other FP8 weight (attention's projections, dense MLPs) is
dequantized at load into the model's dtype and runs on cuBLAS: at
V2-Lite's shapes bf16 cuBLAS beats our W8A8 Triton GEMM (``engine.fp8_kernels.gemm``) at every batch size, and
torch's block-scaled ``_scaled_mm`` at decode sizes (it wins on some shapes only at prefill sizes, and refuses
some shapes); at decode sizes these GEMMs are bound by latency, not bytes (``benchmarks/fp8_gemm.py``,
docs/benchmarks.md). Those linears are a small share of an MoE model's bytes. At prefill sizes, where they are
bound by compute, ``engine.dense_deep_gemm`` can give them an FP8 copy for DeepGEMM's GEMM on sm90 (on by default:
1.2x a V3-shaped prefill, under 1% of V2-Lite's; ``PDCLUSTER_DENSE_DEEP_GEMM=0`` turns it off). ``kv_b_proj`` would
be dequantized anyway: the absorbed MLA path multiplies by its halves. Off CUDA (the CPU engine) every FP8 weight is
dequantized at load.
"""

from __future__ import annotations

import torch
from torch import nn

from engine import fp8_kernels


def runs_fp8(device: torch.device) -> bool:
    """Whether FP8 checkpoints compute in FP8 on ``device`` (else they are dequantized at load); ValueError
    for a CUDA device that cannot (no FP8 tensor cores, or no Triton), so an FP8 checkpoint fails at load."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not fp8_kernels.supported(index):
        name = torch.cuda.get_device_name(index)
        cap = torch.cuda.get_device_capability(index)
        raise ValueError(f"FP8 checkpoint on {name} (sm{cap[0]}{cap[1]}): FP8 compute needs sm89 or newer "
                         f"(Ada, Hopper) and Triton{'' if fp8_kernels.HAS_TRITON else ' (not installed)'}")
    return True


def weights_held(quantized: bool, dtype: torch.dtype, device: torch.device) -> str:
    """How an engine on ``device`` computing in ``dtype`` holds a checkpoint's weights, in words for ``pdctl
    status``: ``bfloat16``; ``fp8 experts, bfloat16`` (a block-FP8 checkpoint on CUDA, where its experts compute
    in FP8: an engine on a GPU that cannot fails at load, ``runs_fp8``); ``float32, from fp8`` (dequantized at
    load). Reads no device, so a node's parent process can say it without touching CUDA."""
    name = str(dtype).removeprefix("torch.")
    if not quantized:
        return name
    return f"fp8 experts, {name}" if device.type == "cuda" else f"{name}, from fp8"


def use_fp8_compute(model: nn.Module) -> None:
    """Hold ``model``'s routed experts in block FP8 (call on the meta-device model, before its storage is
    allocated)."""
    from engine.layers import MoE

    for module in model.modules():
        if isinstance(module, MoE):
            module.hold_fp8()
