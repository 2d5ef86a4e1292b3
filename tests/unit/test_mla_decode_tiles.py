"""The decode kernel's launch shape (``engine.mla_decode._tiles``), chosen from shapes alone on the host: 16-bit
rows take pipelined 32-token tiles; 8-bit rows read by 16-bit queries take 64-token tiles with one stage where a
row has few splits (many rows a launch), and the pipelined ones where it has many (one row over every SM, each
split a tile or two of its real context, whatever the block table's width)."""

from __future__ import annotations

import pytest

from engine import mla_decode


@pytest.fixture(autouse=True)
def _default_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    for knob in ("BLOCK_H", "BLOCK_N", "NUM_WARPS", "NUM_STAGES"):
        monkeypatch.setattr(mla_decode, knob, None)


def test_16_bit_rows_take_pipelined_32_token_tiles() -> None:
    assert mla_decode._tiles(16, False, 2048, 4) == (16, 32, 4, 3)
    assert mla_decode._tiles(128, False, 4096, 2) == (64, 32, 8, 2)


def test_8_bit_rows_in_few_splits_take_64_token_tiles_without_a_pipeline() -> None:
    assert mla_decode._tiles(16, True, 2048, 4) == (16, 64, 4, 1)  # batch 64 x 8k tokens
    assert mla_decode._tiles(16, True, 256, 2) == (16, 64, 4, 1)  # batch 256 x 512
    assert mla_decode._tiles(128, True, 1024, 8) == (64, 64, 8, 1)


def test_8_bit_rows_in_many_or_short_splits_keep_the_pipelined_tiles() -> None:
    # batch 1 in a graph whose table is 32k tokens wide: 128 splits of up to 256, an 8k context's a tile each
    assert mla_decode._tiles(16, True, 256, 128) == (16, 32, 4, 3)
    assert mla_decode._tiles(16, True, 64, 8) == (16, 32, 4, 3)  # splits too short for two 64-token tiles


def test_knobs_override_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mla_decode, "BLOCK_N", 32)
    assert mla_decode._tiles(16, True, 2048, 4) == (16, 32, 4, 3)
    monkeypatch.setattr(mla_decode, "BLOCK_N", None)
    monkeypatch.setattr(mla_decode, "NUM_STAGES", 2)
    assert mla_decode._tiles(16, True, 2048, 4) == (16, 32, 4, 2)
