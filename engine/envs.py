"""Environment variables the engine reads: all of them, typed, read when asked (never at import).

- ``PDCLUSTER_STEP_TIMING=1``: each rank prints how long each phase of a step took (synchronising).
- ``PDCLUSTER_PROFILE_STEP=N``: rank 0 prints a torch.profiler table of its N-th step.
- ``PDCLUSTER_PROFILE_TRACE=DIR``: with ``PDCLUSTER_PROFILE_STEP``, rank 0 also writes a Chrome trace
  of that step to ``DIR/rank0-step<N>.json``.
- ``PDCLUSTER_LOG_LEVEL``: the log level of every cluster process (nodes, their rank and replica
  processes): DEBUG, INFO (default), WARNING, ...
- ``PDCLUSTER_DEEP_GEMM``: 1 or unset: block-FP8 experts at prefill sizes on sm90 run DeepGEMM's grouped GEMMs
  where it is installed (``engine.moe_deep_gemm``; faster than our Triton kernels there, docs/benchmarks.md);
  0: our Triton kernels, and DeepGEMM is not imported.
- ``PDCLUSTER_DENSE_DEEP_GEMM``: 1 or unset: a block-FP8 model's dense linears (attention's projections, dense
  MLPs) multiply prefill steps of 4,096+ rows through DeepGEMM's FP8 GEMM on sm90, from an FP8 copy of their
  weights (``engine.dense_deep_gemm``; held only where a step can reach 4,096 rows; ~12 GB a rank on V3);
  0: bf16 at every size, and no copy is held. On an H100 it makes a 4-layer V3-shaped prefill 1.2x faster and a
  V2-Lite one under 1% (docs/benchmarks.md, thirteenth and fourteenth sessions). ``PDCLUSTER_DEEP_GEMM=0`` turns
  it off too.
- ``PDCLUSTER_FLASHMLA``: 1 or unset: decode attention over an ``fp8`` KV cache of 64-token blocks on sm90 runs
  FlashMLA's FP8 kernel where it is installed (``engine.mla_decode_flashmla``; faster than our Triton kernel there,
  at a larger error, docs/benchmarks.md); 0: our Triton kernel, and FlashMLA is not imported.
"""

from __future__ import annotations

import os


def step_timing() -> bool:
    return os.environ.get("PDCLUSTER_STEP_TIMING", "0") == "1"


def _switch(name: str, default: str) -> bool:
    """A 0 / 1 switch; any other value refused by name."""
    value = os.environ.get(name, default)
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def deep_gemm() -> bool:
    return _switch("PDCLUSTER_DEEP_GEMM", "1")


def dense_deep_gemm() -> bool:
    return _switch("PDCLUSTER_DENSE_DEEP_GEMM", "1")


def flashmla() -> bool:
    return _switch("PDCLUSTER_FLASHMLA", "1")


def profile_step() -> int | None:
    value = os.environ.get("PDCLUSTER_PROFILE_STEP")
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"PDCLUSTER_PROFILE_STEP must be a step number, got {value!r}") from None


def profile_trace_dir() -> str | None:
    return os.environ.get("PDCLUSTER_PROFILE_TRACE") or None


LOG_FORMAT = "%(asctime)s %(processName)s %(name)s %(levelname)s %(message)s"


def log_level() -> str:
    value = os.environ.get("PDCLUSTER_LOG_LEVEL", "INFO").upper()
    if value not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"PDCLUSTER_LOG_LEVEL must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {value!r}")
    return value
