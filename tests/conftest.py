"""Shared fixtures: tiny models made once per session, GPU tests skipped without CUDA, and the logs
of the clusters a failed test ran against in its report."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdctl.tiny_model import make_tiny_model

CLUSTER_RUN_DIRS = pytest.StashKey[list[Path]]()
LOG_TAIL_LINES = 40


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
    for run_dir in item.config.stash.get(CLUSTER_RUN_DIRS, []):
        for log in sorted((run_dir / "logs").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
            report.sections.append((f"cluster log {log.name} (last {LOG_TAIL_LINES} lines)", "\n".join(lines)))
