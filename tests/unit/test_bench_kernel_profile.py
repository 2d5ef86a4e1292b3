"""``benchmarks/engine.py``'s summary of a profiled decode: kernels per step, the GPU's busy time as the union of
kernel intervals, and its idle time split into short gaps (launches) and long ones (the GPU waiting for the host)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _bench(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN202
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # its sibling modules, as when it runs as a script
    spec = importlib.util.spec_from_file_location("bench_engine", ROOT / "benchmarks" / "engine.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _kernel(name: str, start: float, end: float) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA,
                           time_range=SimpleNamespace(start=start, end=end))


def test_busy_time_and_idle_gaps_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    host = SimpleNamespace(name="cudaGraphLaunch", device_type=torch.autograd.DeviceType.CPU,
                           time_range=SimpleNamespace(start=0.0, end=5000.0))
    # two steps (µs): overlapping kernels count once; 10 µs gaps are launches, 200 and 300 µs the host's
    events = [_kernel("a", 0, 100), _kernel("b", 50, 150), _kernel("a", 160, 400), _kernel("c", 600, 700),
              _kernel("a", 710, 1000), _kernel("b", 1300, 1400), host]
    prof = SimpleNamespace(events=lambda: events)
    got = _bench(monkeypatch).kernel_profile(prof, steps=2, wall_s=1.5e-3)
    assert got["kernels_per_step"] == 3.0
    assert got["gpu_busy_ms_per_step"] == round((150 + 240 + 100 + 290 + 100) / 1e3 / 2, 3)
    assert got["idle_ms_per_step_in_gaps_under_50us"] == round(20 / 1e3 / 2, 3)
    assert got["idle_gaps_over_50us_per_step"] == 1.0
    assert got["idle_ms_per_step_in_gaps_over_50us"] == round(500 / 1e3 / 2, 3)
    assert got["step_ms"] == 0.75 and got["top_kernels_ms_per_step"]["a"] == round((100 + 240 + 290) / 1e3 / 2, 3)
