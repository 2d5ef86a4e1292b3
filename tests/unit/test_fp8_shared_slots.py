"""Block-FP8 MoE layers hold their shared experts as slots of the expert stack (``MoE.hold_fp8``): the loader
splits the checkpoint's shared MLP (weights and scales) into them exactly, the slots compute what the shared MLP
does, and a missing shared tensor is named. The FP8 kernels are CUDA-only (tests/gpu/test_fp8_gpu.py runs them);
here the FP8-held model is built on the CPU and its stack dequantized by a plain torch reference."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.config import ModelConfig
from engine.fp8 import FP8_DTYPE, SCALE_SUFFIX, dequantize_blocks, quantize_blocks
from engine.fp8_compute import use_fp8_compute
from engine.layers import MoE
from engine.model import DeepseekForCausalLM
from engine.weights import _slot_pieces, build_empty_model, load_weights


def _held(path: Path) -> DeepseekForCausalLM:
    """The FP8 checkpoint at ``path`` loaded as a CUDA device would hold it (routed experts and shared slots in
    FP8), on the CPU."""
    cfg = ModelConfig.from_pretrained(path)
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg)
        use_fp8_compute(model)
    model = model.to_empty(device=torch.device("cpu")).eval().requires_grad_(False)
    model.init_rope(torch.device("cpu"))
    load_weights(model, path)
    return model


def _moes(model: DeepseekForCausalLM) -> dict[str, MoE]:
    return {i: layer.mlp for i, layer in model.model.layers.items() if isinstance(layer.mlp, MoE)}


def test_the_shared_mlp_loads_into_the_stacks_slots_byte_for_byte(fp8_model) -> None:
    fp8, _ = fp8_model
    model = _held(fp8)
    cfg = model.cfg
    e, s = cfg.n_routed_experts, cfg.n_shared_experts
    with safe_open(str(fp8 / "model.safetensors"), framework="pt") as f:
        for i, moe in _moes(model).items():
            assert (moe.routed, moe.shared_slots, moe.shared_experts) == (e, s, None)
            assert moe.w13.dtype == FP8_DTYPE and moe.w13.shape[0] == moe.w2.shape[0] == e + s
            p = f"model.layers.{i}.mlp.shared_experts."
            gate, up, down = (f.get_tensor(p + n + ".weight") for n in ("gate_proj", "up_proj", "down_proj"))
            gs, us, ds = (f.get_tensor(p + n + ".weight" + SCALE_SUFFIX) for n in ("gate_proj", "up_proj", "down_proj"))
            i_cols = cfg.moe_intermediate_size
            for j in range(s):
                cols = slice(j * i_cols, (j + 1) * i_cols)
                w13, w2 = moe.w13[e + j].view(torch.uint8), moe.w2[e + j].view(torch.uint8)
                assert torch.equal(w13[:i_cols], gate[cols].view(torch.uint8))
                assert torch.equal(w13[i_cols:], up[cols].view(torch.uint8))
                assert torch.equal(w2, down[:, cols].view(torch.uint8))
                # I = 64: both slots' columns lie in the MLP's first 128-block, so both take its scales
                half = moe.w13_scale_inv.shape[1] // 2
                assert torch.equal(moe.w13_scale_inv[e + j, :half], gs[: half])
                assert torch.equal(moe.w13_scale_inv[e + j, half:], us[: half])
                assert torch.equal(moe.w2_scale_inv[e + j], ds[:, :1])
    routed = sum(m.w13[: m.routed].numel() + m.w2[: m.routed].numel() for m in _moes(model).values())
    assert model.routed_expert_params() == routed


def test_the_slots_compute_the_shared_mlp(fp8_model) -> None:
    """Each MoE layer of the FP8-held model, its stack dequantized and every token's choices plus the shared
    slots summed by a torch reference (``fused_experts(shared=S)`` and ``combine(slots=S)``'s sum, which
    tests/gpu/test_fused_kernels.py checks against the kernels), equals the dequantized twin's layer (a
    separate shared MLP) in fp32."""
    fp8, twin = fp8_model
    held = _held(fp8)
    ref = build_empty_model(ModelConfig.from_pretrained(twin), torch.float32, torch.device("cpu"))
    load_weights(ref, twin)
    g = torch.Generator().manual_seed(0)
    for i, moe in _moes(held).items():
        x = torch.randn(37, held.cfg.hidden_size, generator=g)

        def deq(w: torch.Tensor, sc: torch.Tensor, halves: int) -> torch.Tensor:
            return torch.cat([dequantize_blocks(a, b) for a, b in zip(w.chunk(halves), sc.chunk(halves))])

        w13 = torch.stack([deq(w, sc, 2) for w, sc in zip(moe.w13, moe.w13_scale_inv)])
        w2 = torch.stack([deq(w, sc, 1) for w, sc in zip(moe.w2, moe.w2_scale_inv)])
        weights, ids = moe.gate(x)
        assert bool((ids < moe.routed).all())
        slots = range(moe.routed, moe.routed + moe.shared_slots)  # every token's, with weight 1
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for w, e in [*zip(weights[t].tolist(), ids[t].tolist()), *((1.0, j) for j in slots)]:
                gate, up = (x[t] @ w13[e].T).chunk(2)
                out[t] += w * ((torch.nn.functional.silu(gate) * up) @ w2[e].T)
        want = ref.model.layers[i].mlp(x)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cols", [64, 256])
def test_slot_pieces_split_weights_and_scales_by_block(cols: int) -> None:
    g = torch.Generator().manual_seed(cols)
    gate = torch.randn(3 * cols, 384, generator=g)
    q, sc = quantize_blocks(gate)
    pieces = _slot_pieces(q, 3, cols, "gate_proj", "x.weight")
    scales = _slot_pieces(sc, 3, cols, "gate_proj", "x.weight" + SCALE_SUFFIX)
    for j, (pq, ps) in enumerate(zip(pieces, scales)):
        # each slot dequantized with its own scales is the MLP's dequantized rows
        want = dequantize_blocks(q, sc)[j * cols : (j + 1) * cols]
        assert torch.equal(dequantize_blocks(pq, ps), want)
    down_q, down_s = quantize_blocks(torch.randn(384, 3 * cols, generator=g))
    for j, (pq, ps) in enumerate(zip(_slot_pieces(down_q, 3, cols, "down_proj", "y.weight"),
                                     _slot_pieces(down_s, 3, cols, "down_proj", "y.weight" + SCALE_SUFFIX))):
        assert torch.equal(dequantize_blocks(pq, ps), dequantize_blocks(down_q, down_s)[:, j * cols : (j + 1) * cols])
    with pytest.raises(ValueError, match="3 shared experts of"):
        _slot_pieces(q[:-1], 3, cols, "gate_proj", "x.weight")
    with pytest.raises(ValueError, match="not the blocks of 3 shared experts"):
        _slot_pieces(torch.cat([sc, sc[:1]]), 3, cols, "gate_proj", "x.weight" + SCALE_SUFFIX)


def test_a_missing_shared_tensor_is_named(fp8_model, tmp_path: Path) -> None:
    fp8, _ = fp8_model
    bad = tmp_path / "bad"
    shutil.copytree(fp8, bad)
    name = "model.layers.1.mlp.shared_experts.up_proj.weight"
    with safe_open(str(bad / "model.safetensors"), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys() if n not in (name, name + SCALE_SUFFIX)}
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing .*shared_experts\.up_proj\.weight"):
        _held(bad)
