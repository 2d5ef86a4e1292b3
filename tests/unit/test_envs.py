"""The engine's environment switches (``engine.envs``): read when asked, bad values refused by name."""

from __future__ import annotations

import pytest

from engine import envs, moe_deep_gemm


def test_deep_gemm_is_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDCLUSTER_DEEP_GEMM", raising=False)
    assert envs.deep_gemm() is True
    monkeypatch.setenv("PDCLUSTER_DEEP_GEMM", "0")
    assert envs.deep_gemm() is False
    moe_deep_gemm._module.cache_clear()
    assert moe_deep_gemm._module() is None  # off: DeepGEMM is not imported even where it is installed
    monkeypatch.setenv("PDCLUSTER_DEEP_GEMM", "yes")
    with pytest.raises(ValueError, match="PDCLUSTER_DEEP_GEMM must be 0 or 1"):
        envs.deep_gemm()
    moe_deep_gemm._module.cache_clear()


def test_flashmla_is_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import mla_decode_flashmla

    monkeypatch.delenv("PDCLUSTER_FLASHMLA", raising=False)
    assert envs.flashmla() is True
    monkeypatch.setenv("PDCLUSTER_FLASHMLA", "0")
    assert envs.flashmla() is False
    mla_decode_flashmla._ops.cache_clear()
    assert mla_decode_flashmla._ops() is None  # off: FlashMLA is not imported even where it is installed
    mla_decode_flashmla._ops.cache_clear()
    monkeypatch.setenv("PDCLUSTER_FLASHMLA", "on")
    with pytest.raises(ValueError, match="PDCLUSTER_FLASHMLA must be 0 or 1"):
        envs.flashmla()


def test_bad_values_are_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCLUSTER_PROFILE_STEP", "first")
    with pytest.raises(ValueError, match="PDCLUSTER_PROFILE_STEP"):
        envs.profile_step()
    monkeypatch.setenv("PDCLUSTER_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="PDCLUSTER_LOG_LEVEL"):
        envs.log_level()
