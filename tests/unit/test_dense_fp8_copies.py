"""Which dense linears of a block-FP8 model get an FP8 copy for prefill steps, and which steps take it
(``engine.dense_deep_gemm``; DeepGEMM's product itself needs an sm90 GPU: tests/gpu/test_dense_deep_gemm.py). Here
DeepGEMM's call is the same product in torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import dense_deep_gemm
from engine.fp8 import dequantize_blocks


def _model() -> nn.Module:
    """A decoder layer's linears under the checkpoint's names, in bf16."""
    attn, mlp = nn.Module(), nn.Module()
    attn.q_proj = nn.Linear(256, 384, bias=False)
    attn.kv_a_proj_with_mqa = nn.Linear(256, 128, bias=False)
    attn.kv_b_proj = nn.Linear(128, 256, bias=False)
    attn.o_proj = nn.Linear(256, 256, bias=False)
    mlp.gate_proj = nn.Linear(256, 200, bias=False)  # not whole 128-blocks
    mlp.gate = nn.Linear(256, 128, bias=False)  # the router's gate: not quantized by DeepSeek
    layer = nn.Module()
    layer.self_attn, layer.mlp = attn, mlp
    body = nn.Module()
    body.layers = nn.ModuleDict({"0": layer})
    root = nn.Module()
    root.model = body
    return root.to(torch.bfloat16)


@pytest.fixture
def product(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """DeepGEMM usable, its product in torch (the FP8 copy dequantized); returns the rows of each call."""
    rows: list[int] = []

    def linear(x: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
        rows.append(x.shape[0])
        return (x.float() @ dequantize_blocks(w8, ws).T).to(torch.bfloat16)

    monkeypatch.setattr(dense_deep_gemm, "usable", lambda device: True)
    monkeypatch.setattr(dense_deep_gemm, "linear", linear)
    monkeypatch.setattr(dense_deep_gemm, "_state", {"failed": False})
    return rows


def test_the_attention_projections_but_kv_a_hold_a_copy(product: list[int]) -> None:
    model = _model()
    params = dict(model.named_parameters())
    assert dense_deep_gemm.hold_fp8_copies(model) == 3
    held = {n for n, m in model.named_modules() if isinstance(m, dense_deep_gemm.PrefillFp8Linear)}
    assert held == {f"model.layers.0.self_attn.{p}" for p in ("q_proj", "kv_b_proj", "o_proj")}
    # the same parameters (the bf16 weights, shared), nothing the loader or a state dict would see added
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == {n: p.data_ptr() for n, p in params.items()}
    assert set(model.state_dict()) == set(params)
    q = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert q.w8.dtype == torch.float8_e4m3fn and q.w8.shape == (384, 256) and q.w_scale.shape == (3, 2)
    # the copy is the bf16 weight's blocks in e4m3: back in bf16 it is within e4m3's rounding
    back = dequantize_blocks(q.w8, q.w_scale)
    assert float((back - q.weight.float()).norm() / q.weight.float().norm()) < 4e-2
    assert dense_deep_gemm.hold_fp8_copies(model) == 0  # nothing left to swap


def test_prefill_sized_steps_take_the_copy_and_smaller_ones_bf16(product: list[int],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dense_deep_gemm, "MIN_ROWS", 16)
    model = _model()
    dense_deep_gemm.hold_fp8_copies(model)
    o = model.get_submodule("model.layers.0.self_attn.o_proj")
    small = torch.randn(15, 256).to(torch.bfloat16)
    assert torch.equal(o(small), F.linear(small, o.weight)) and product == []
    big = torch.randn(16, 256).to(torch.bfloat16)
    got = o(big)
    assert product == [16]
    assert float((got.float() - F.linear(big, o.weight).float()).norm() / got.float().norm()) < 4e-2


def test_a_deep_gemm_failure_goes_back_to_bf16(product: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dense_deep_gemm, "MIN_ROWS", 4)
    model = _model()
    dense_deep_gemm.hold_fp8_copies(model)
    o = model.get_submodule("model.layers.0.self_attn.o_proj")
    monkeypatch.setattr(dense_deep_gemm, "linear", lambda x, w8, ws: None)  # as after a failed compile
    x = torch.randn(8, 256).to(torch.bfloat16)
    assert torch.equal(o(x), F.linear(x, o.weight))


def test_a_failed_warm_up_releases_the_copies(product: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepGEMM failing at warm-up (its compile): the linears are plain bf16 ones again on the same weights, and no
    FP8 copy keeps memory the KV cache would get."""
    monkeypatch.setattr(dense_deep_gemm, "MIN_ROWS", 4)
    model = _model()
    weights = {n: p.data_ptr() for n, p in model.named_parameters()}
    assert dense_deep_gemm.hold_fp8_copies(model, max_rows=8) == 3

    def fail(x: torch.Tensor, w8: torch.Tensor, ws: torch.Tensor) -> None:
        dense_deep_gemm._state["failed"] = True
        return None

    monkeypatch.setattr(dense_deep_gemm, "linear", fail)
    assert dense_deep_gemm.warm_up(model, 8) == 0
    assert not any(isinstance(m, dense_deep_gemm.PrefillFp8Linear) for m in model.modules())
    assert not any(hasattr(m, "w8") for m in model.modules())
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == weights
    o = model.get_submodule("model.layers.0.self_attn.o_proj")
    x = torch.randn(8, 256).to(torch.bfloat16)
    assert type(o) is nn.Linear and torch.equal(o(x), F.linear(x, o.weight))


def test_a_warm_up_that_works_keeps_the_copies(product: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dense_deep_gemm, "MIN_ROWS", 4)
    model = _model()
    dense_deep_gemm.hold_fp8_copies(model, max_rows=8)
    assert dense_deep_gemm.warm_up(model, 8) == 3 * 2  # three shapes at 4 and 8 rows
    assert sum(isinstance(m, dense_deep_gemm.PrefillFp8Linear) for m in model.modules()) == 3


def test_without_deep_gemm_nothing_changes() -> None:
    model = _model()
    assert dense_deep_gemm.hold_fp8_copies(model) == 0  # CPU: not usable
    assert not any(isinstance(m, dense_deep_gemm.PrefillFp8Linear) for m in model.modules())


def test_warm_ups_run_each_doubling_of_the_rows_then_the_most() -> None:
    from engine.moe_deep_gemm import doublings

    assert doublings(2048, 16384) == [2048, 4096, 8192, 16384]
    assert doublings(2048, 5000) == [2048, 4096, 5000]
    assert doublings(2048, 2048) == [2048]


def test_an_engine_whose_steps_stay_under_min_rows_holds_no_copy(product: list[int]) -> None:
    """A batch budget under MIN_ROWS (the default 2,048) never takes a copy, so none is held."""
    model = _model()
    assert dense_deep_gemm.hold_fp8_copies(model, max_rows=dense_deep_gemm.MIN_ROWS - 1) == 0
    assert not any(isinstance(m, dense_deep_gemm.PrefillFp8Linear) for m in model.modules())
    assert dense_deep_gemm.hold_fp8_copies(model, max_rows=dense_deep_gemm.MIN_ROWS) == 3


def test_a_step_has_at_most_the_budget_and_a_pcp_rank_its_share() -> None:
    """``executor.step_rows``: the scheduler fills a step with several requests' chunks up to the budget (not
    bounded by max_model_len); a PCP rank gets its share of the prompt rows plus at most a decode row a sequence."""
    from engine.engine_config import EngineConfig
    from engine.executor import step_rows

    assert step_rows(EngineConfig(model="m", max_num_batched_tokens=8192, max_model_len=2048)) == 8192
    assert step_rows(EngineConfig(model="m", max_num_batched_tokens=8192, pcp=2, max_num_seqs=256)) == 4096 + 256
    assert step_rows(EngineConfig(model="m", max_num_batched_tokens=1024, pcp=4, max_num_seqs=256)) == 512
    assert step_rows(EngineConfig(model="m", max_num_batched_tokens=1024, pcp=4, max_num_seqs=900)) == 1024
