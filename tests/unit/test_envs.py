"""The engine's environment switches (``engine.envs``): read when asked, bad values refused by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

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


def test_bad_values_are_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCLUSTER_PROFILE_STEP", "first")
    with pytest.raises(ValueError, match="PDCLUSTER_PROFILE_STEP"):
        envs.profile_step()
    monkeypatch.setenv("PDCLUSTER_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="PDCLUSTER_LOG_LEVEL"):
        envs.log_level()
