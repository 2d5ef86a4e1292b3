"""Structured output's engine tests (tests/unit/test_structured_output.py) on a GPU: the masks are filled on
the host and applied to the logits on the device, after the CUDA-graph decode step."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from engine import LLM

pytestmark = pytest.mark.gpu

_CPU_TESTS = Path(__file__).parents[1] / "unit" / "test_structured_output.py"
_spec = importlib.util.spec_from_file_location("cpu_structured_output_tests", _CPU_TESTS)
assert _spec is not None and _spec.loader is not None
_cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cpu)
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
