"""``engine.mla_decode_flashmla``'s per-step schedule: made by a step's first layer and reused by the rest,
remade when the lengths or tables are another tensor, never kept without a
step cache. FlashMLA itself runs on sm90 only (tests/gpu/test_mla_decode_flashmla.py); here its schedule
op is a stand-in that counts calls."""

from __future__ import annotations

import pytest
import torch

from engine import mla_decode_flashmla
from engine.forward_batch import StepMemo
from engine.kv_format import KVFormat


class _CountingOps:
    def __init__(self) -> None:
        self.calls = 0

    def get_mla_decoding_metadata_dense_fp8(self, lens: torch.Tensor, heads: int, q_heads_per_k: int) -> tuple:
        self.calls += 1
        return lens * heads, torch.zeros(lens.shape[0] + 1, dtype=torch.int32)


@pytest.fixture
def ops(monkeypatch: pytest.MonkeyPatch) -> _CountingOps:
    fake = _CountingOps()
    monkeypatch.setattr(mla_decode_flashmla, "_ops", lambda: fake)
    return fake


@torch.inference_mode()  # as the engine runs
def test_a_step_computes_its_schedule_once(ops: _CountingOps) -> None:
    lens, tables, memo = torch.tensor([5, 0, 70]), torch.zeros(3, 2, dtype=torch.long), StepMemo()
    first = mla_decode_flashmla._schedule(lens, tables, 16, 0.5, memo)
    for _ in range(26):  # the other layers of the step
        assert mla_decode_flashmla._schedule(lens, tables, 16, 0.5, memo) is first
    assert ops.calls == 1
    lens32, tables32, meta, _, k_scale, live = first
    assert lens32.dtype == tables32.dtype == torch.int32 and lens32.tolist() == [5, 1, 70]
    assert meta.tolist() == [80, 16, 1120] and k_scale.tolist() == [0.5] and live.tolist() == [True, False, True]


def test_the_schedule_is_remade_for_new_lengths_tables_or_heads(ops: _CountingOps) -> None:
    lens, tables, memo = torch.tensor([5, 9]), torch.zeros(2, 1, dtype=torch.long), StepMemo()
    mla_decode_flashmla._schedule(lens, tables, 16, 1.0, memo)
    assert mla_decode_flashmla._schedule(lens + 1, tables, 16, 1.0, memo)[0].tolist() == [6, 10]
    mla_decode_flashmla._schedule(lens.clone(), tables, 16, 1.0, memo)  # another tensor of equal values
    mla_decode_flashmla._schedule(lens, tables.clone(), 16, 1.0, memo)
    mla_decode_flashmla._schedule(lens, tables, 128, 1.0, memo)
    mla_decode_flashmla._schedule(lens, tables, 128, 2.0, memo)  # another layer's scale (the MTP layer's)
    assert ops.calls == 6
    for _ in range(3):  # no cache: every call its own
        mla_decode_flashmla._schedule(lens, tables, 128, 2.0, None)
    assert ops.calls == 9


def test_the_start_up_log_says_which_kernel_decodes_fp8_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda, bf16 = torch.device("cuda", 0), torch.bfloat16
    fp8 = KVFormat("fp8", 512, 64, bf16)
    kernel = mla_decode_flashmla.decode_kernel
    assert kernel(fp8, 64, bf16, torch.device("cpu")) is None
    assert kernel(KVFormat("auto", 512, 64, bf16), 64, bf16, cuda) is None
    monkeypatch.setattr(mla_decode_flashmla, "sm90", lambda index: False)
    assert "needs sm90" in str(kernel(fp8, 64, bf16, cuda))
    monkeypatch.setattr(mla_decode_flashmla, "sm90", lambda index: True)
    assert "this engine's are torch.float32 of 512 + 64" in str(kernel(fp8, 64, torch.float32, cuda))
    assert "this engine's are torch.bfloat16 of 256 + 32" in str(kernel(KVFormat("fp8", 256, 32, bf16), 64, bf16, cuda))
    assert "needs block_size 64; this engine's is 16" in str(kernel(fp8, 16, bf16, cuda))
    monkeypatch.setattr(mla_decode_flashmla, "_ops", lambda: None)
    assert "not installed" in str(kernel(fp8, 64, bf16, cuda))
    monkeypatch.setattr(mla_decode_flashmla, "_ops", lambda: object())
    assert kernel(fp8, 64, bf16, cuda) == "FlashMLA's FP8 kernel"
