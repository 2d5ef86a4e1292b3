"""The engine's environment switches (``engine.envs``): read when asked, bad values refused by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine import envs, mla_decode_flashmla, moe_deep_gemm


@pytest.mark.parametrize(("name", "switch", "library", "bad"), [
    ("PDCLUSTER_DEEP_GEMM", envs.deep_gemm, moe_deep_gemm.library, "yes"),
    ("PDCLUSTER_FLASHMLA", envs.flashmla, mla_decode_flashmla._ops, "on"),
], ids=["deep_gemm", "flashmla"])
def test_library_kernels_are_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch, name: str,
                                                  switch: Callable[[], bool], library: Any, bad: str) -> None:
    monkeypatch.delenv(name, raising=False)
    assert switch() is True
    monkeypatch.setenv(name, "0")
    assert switch() is False
    library.cache_clear()
    assert library() is None  # off: the library is not imported even where it is installed
    library.cache_clear()
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=f"{name} must be 0 or 1"):
        switch()


def test_the_dense_deep_gemm_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """On unless 0 (V3-shaped prefill 1.2x on an H100); off, no model gets FP8 copies of its dense linears even
    where DeepGEMM loads."""
    from engine import dense_deep_gemm

    monkeypatch.setattr(dense_deep_gemm, "HAS_TRITON", True)  # an sm90 GPU where DeepGEMM loads
    monkeypatch.setattr(dense_deep_gemm, "sm90", lambda index: True)
    monkeypatch.setattr(moe_deep_gemm, "library", lambda: object())
    gpu = torch.device("cuda", 0)
    monkeypatch.delenv("PDCLUSTER_DENSE_DEEP_GEMM", raising=False)
    assert envs.dense_deep_gemm() is True and dense_deep_gemm.usable(gpu)
    monkeypatch.setenv("PDCLUSTER_DENSE_DEEP_GEMM", "1")
    assert envs.dense_deep_gemm() is True and dense_deep_gemm.usable(gpu)
    monkeypatch.setenv("PDCLUSTER_DENSE_DEEP_GEMM", "0")
    assert envs.dense_deep_gemm() is False and not dense_deep_gemm.usable(gpu)
    monkeypatch.setenv("PDCLUSTER_DENSE_DEEP_GEMM", "2")
    with pytest.raises(ValueError, match="PDCLUSTER_DENSE_DEEP_GEMM must be 0 or 1"):
        envs.dense_deep_gemm()


def test_bad_values_are_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCLUSTER_PROFILE_STEP", "first")
    with pytest.raises(ValueError, match="PDCLUSTER_PROFILE_STEP"):
        envs.profile_step()
    monkeypatch.setenv("PDCLUSTER_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="PDCLUSTER_LOG_LEVEL"):
        envs.log_level()
