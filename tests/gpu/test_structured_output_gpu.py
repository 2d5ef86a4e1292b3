"""Structured output's engine tests (tests/unit/test_structured_output.py) on a GPU: the masks are filled on
the host and applied to the logits on the device, after the CUDA-graph decode step."""

from __future__ import annotations

import cpu_tests
import pytest

from engine import LLM

pytestmark = pytest.mark.gpu

_cpu = cpu_tests.load("unit/test_structured_output.py")
# the tests that take the engine fixture (the others do not touch a device)
globals().update({name: getattr(_cpu, name) for name in dir(_cpu)
                  if name.startswith("test_") and "llm" in getattr(_cpu, name).__code__.co_varnames})
CORPUS = _cpu.CORPUS


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(str(tiny_model), dtype="float32", device="cuda", max_model_len=512, max_num_seqs=8,
             gpu_memory_utilization=0.2) as llm:
        assert llm.engine.executor.graphs is not None and llm.engine.executor.graphs.sizes
        yield llm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_bitmask_on_the_device_forbids_exactly_the_clear_bits(dtype: str) -> None:
    """``apply_bitmask`` from a pinned host mask onto device logits (V3's vocabulary), against llguidance's numpy
    kernel."""
    _cpu.check_bitmask(64, 129280, (129280 + 31) // 32, device="cuda", dtype=dtype)
