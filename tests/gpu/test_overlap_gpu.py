"""Overlapped decode steps on a GPU (tests/unit/test_overlap.py again, on the device, fp32): CUDA-graph
replays fed with the previous step's samples on the device, the samples' pinned copy and event, and
block frees that wait for the step in flight."""

from __future__ import annotations

import cpu_tests
import pytest

pytestmark = pytest.mark.gpu

_cpu = cpu_tests.load("unit/test_overlap.py")
_cpu.KW = {**_cpu.KW, "device": "cuda", "gpu_memory_utilization": 0.2}  # fp32: rows equal whatever the batch
globals().update({name: getattr(_cpu, name) for name in dir(_cpu) if name.startswith("test_")})
