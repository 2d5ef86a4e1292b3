"""``engine.mla_decode_flashmla``'s per-step schedule: made by a step's first layer and reused by the rest,
remade when the lengths or tables are another tensor, never kept without a
step cache. FlashMLA itself runs on sm90 only (tests/gpu/test_mla_decode_flashmla.py); here its schedule
op is a stand-in that counts calls."""

from __future__ import annotations

import pytest
import torch

from engine import mla_decode_flashmla


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
    lens, tables, cache = torch.tensor([5, 0, 70]), torch.zeros(3, 2, dtype=torch.long), dict[str, tuple]()
    first = mla_decode_flashmla._schedule(lens, tables, 16, 0.5, cache)
    for _ in range(26):  # the other layers of the step
        assert mla_decode_flashmla._schedule(lens, tables, 16, 0.5, cache) is first
    assert ops.calls == 1
    lens32, tables32, meta, _, k_scale, live = first
    assert lens32.dtype == tables32.dtype == torch.int32 and lens32.tolist() == [5, 1, 70]
    assert meta.tolist() == [80, 16, 1120] and k_scale.tolist() == [0.5] and live.tolist() == [True, False, True]


def test_the_schedule_is_remade_for_new_lengths_tables_or_heads(ops: _CountingOps) -> None:
    lens, tables, cache = torch.tensor([5, 9]), torch.zeros(2, 1, dtype=torch.long), dict[str, tuple]()
    mla_decode_flashmla._schedule(lens, tables, 16, 1.0, cache)
    assert mla_decode_flashmla._schedule(lens + 1, tables, 16, 1.0, cache)[0].tolist() == [6, 10]
    mla_decode_flashmla._schedule(lens.clone(), tables, 16, 1.0, cache)  # another tensor of equal values
    mla_decode_flashmla._schedule(lens, tables.clone(), 16, 1.0, cache)
    mla_decode_flashmla._schedule(lens, tables, 128, 1.0, cache)
    mla_decode_flashmla._schedule(lens, tables, 128, 2.0, cache)  # another layer's scale (the MTP layer's)
    assert ops.calls == 6
    for _ in range(3):  # no cache: every call its own
        mla_decode_flashmla._schedule(lens, tables, 128, 2.0, None)
    assert ops.calls == 9


def test_the_start_up_log_says_which_kernel_decodes_fp8_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda", 0)
    assert mla_decode_flashmla.decode_kernel("fp8", 64, torch.device("cpu")) is None
    assert mla_decode_flashmla.decode_kernel("auto", 64, cuda) is None
    monkeypatch.setattr(mla_decode_flashmla, "sm90", lambda index: False)
    assert "needs sm90" in str(mla_decode_flashmla.decode_kernel("fp8", 64, cuda))
    monkeypatch.setattr(mla_decode_flashmla, "sm90", lambda index: True)
    assert "needs block_size 64; this engine's is 16" in str(mla_decode_flashmla.decode_kernel("fp8", 16, cuda))
    monkeypatch.setattr(mla_decode_flashmla, "_ops", lambda: None)
    assert "not installed" in str(mla_decode_flashmla.decode_kernel("fp8", 64, cuda))
    monkeypatch.setattr(mla_decode_flashmla, "_ops", lambda: object())
    assert mla_decode_flashmla.decode_kernel("fp8", 64, cuda) == "FlashMLA's FP8 kernel"
