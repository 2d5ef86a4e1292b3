"""``layers.Router.hold_bf16``: a router whose weights are bf16 values is held in bf16 on CUDA (its logits then
come from a bf16 GEMM summing in fp32; tests/gpu/test_expert_choice.py checks them there); elsewhere, or where
bf16 would round a weight, it stays fp32. Dummy weights give the gate bf16 values, as checkpoints store it."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.layers import Router
from engine.weights import build_empty_model, init_random_weights


def test_dummy_router_weights_are_bf16_values_and_a_cpu_router_stays_fp32(tiny_model: Path) -> None:
    mc = ModelConfig.from_pretrained(tiny_model)
    model = build_empty_model(mc, torch.float32, torch.device("cpu"))
    init_random_weights(model, seed=0)
    routers = [m for m in model.modules() if isinstance(m, Router)]
    assert routers
    for r in routers:
        assert r.weight.dtype == torch.float32 and bool(r.weight.abs().sum() > 0)
        assert torch.equal(r.weight.to(torch.bfloat16).float(), r.weight)
        assert not r.hold_bf16() and r.weight.dtype == torch.float32 and not r.bf16  # CPU: fp32's GEMM
