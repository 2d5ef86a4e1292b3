"""The sampler's behaviour tests (tests/unit/test_sampling.py) on a GPU, where sampling runs on the device
(batched rows, exponential-race draws from per-request CUDA generators, one wait per step) inside the
CUDA-graph decode path. fp32 keeps the logits of a request equal whatever its neighbours (bf16 GEMMs at
other batch sizes round differently, which could move a seeded draw at a near-tie)."""

from __future__ import annotations

import cpu_tests
import pytest

from engine import LLM

pytestmark = pytest.mark.gpu

_cpu = cpu_tests.load("unit/test_sampling.py")
globals().update({name: getattr(_cpu, name) for name in dir(_cpu) if name.startswith("test_")})


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(str(tiny_model), dtype="float32", device="cuda", max_model_len=256, max_num_seqs=8,
             gpu_memory_utilization=0.2) as llm:
        assert llm.engine.executor.graphs is not None and llm.engine.executor.graphs.sizes
        yield llm
