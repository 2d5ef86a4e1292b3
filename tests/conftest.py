"""Shared fixtures: tiny models made once per session, GPU tests skipped without CUDA, and in a failed test's
report the logs of the clusters it ran against and the times the machine itself stalled meanwhile."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from host_stalls import HostStallWatch

from pdctl.tiny_model import make_tiny_model

CLUSTER_RUN_DIRS = pytest.StashKey[list[Path]]()
LOG_TAIL_LINES = 40


HOST_STALLS = HostStallWatch()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The three tiny parity configs: V2 dense, V2 MoE, V3 (q_lora_rank, noaux_tc)."""
    root = tmp_path_factory.mktemp("models")
    return {
        "v2_dense": make_tiny_model(root / "v2_dense", arch="v2", moe=False, seed=1),
        "v2_moe": make_tiny_model(root / "v2_moe", arch="v2", moe=True, seed=2),
        "v3": make_tiny_model(root / "v3", arch="v3", moe=True, seed=3),
    }


@pytest.fixture(scope="session")
def tiny_model(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["v2_moe"]


@pytest.fixture(scope="session")
def cluster_run_dirs(pytestconfig: pytest.Config) -> list[Path]:
    """Run dirs of the clusters started for tests; a failed test's report shows their logs' tails."""
    return pytestconfig.stash.setdefault(CLUSTER_RUN_DIRS, [])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    stalls = HOST_STALLS.during(call.start, call.stop)
    if stalls:
        report.sections.append(("host stalls (the VM's vCPUs did not run)", "\n".join(stalls)))
    for run_dir in item.config.stash.get(CLUSTER_RUN_DIRS, []):
        for log in sorted((run_dir / "logs").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            report.sections.append((f"cluster log {log.name} (last {LOG_TAIL_LINES} lines)", "\n".join(lines)))


@pytest.fixture(scope="session")
def fp8_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny block-FP8 checkpoint (``make-model --quantize fp8``: the V2 MoE shape) and its dequantized twin:
    the same model with every FP8 weight written in float32 as ``engine.fp8`` dequantizes it, and no
    quantization_config."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine.fp8 import SCALE_SUFFIX, dequantize_blocks

    root = tmp_path_factory.mktemp("fp8")
    fp8 = make_tiny_model(root / "fp8", arch="v2", moe=True, seed=2, quantize="fp8")
    twin = make_tiny_model(root / "twin", arch="v2", moe=True, seed=2)  # tokenizer and config, then the weights
    with safe_open(str(fp8 / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        tensors = {n: f.get_tensor(n) for n in names}
    weights = {n: dequantize_blocks(t, tensors[n + SCALE_SUFFIX]) if n + SCALE_SUFFIX in tensors else t
               for n, t in tensors.items() if not n.endswith(SCALE_SUFFIX)}
    save_file(weights, str(twin / "model.safetensors"), metadata={"format": "pt"})
    assert "quantization_config" not in json.loads((twin / "config.json").read_text())
    return fp8, twin
