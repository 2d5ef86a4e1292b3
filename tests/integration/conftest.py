"""Integration tests run real processes: none may outlive its test. Also the proxy against fake nodes
(``fake_cluster``, ``c``) for the ``test_proxy_fake_*`` modules, and each topology's rank processes started
once for the modules that check them (``topology_runs``, ``pcp2_pp2_handoffs``)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_cluster import Cluster, reset
from fake_cluster import fake_cluster as start_fake_cluster
from pcp2_pp2_handoff import handoff
from procs import rank_children
from topology_runs import Run, run_topology


@pytest.fixture(autouse=True)
def no_leftover_processes() -> Iterator[None]:
    # Processes of wider-scoped fixtures (set up before this one: a module's cluster, e.g. its proxy's
    # server worker) belong to them, not to the test.
    before = {p.pid for p in rank_children()}
    yield

    def new() -> list:
        return [p for p in rank_children() if p.pid not in before]

    deadline = time.monotonic() + 5
    while new() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = new()
    for p in left:
        p.kill()
    assert not left, f"test left processes behind: {[p.pid for p in left]}"


@pytest.fixture(scope="module")
def fake_cluster(tiny_model: Path) -> Iterator[Cluster]:
    """A proxy against fake nodes for the whole module (``fake_cluster.py``)."""
    with start_fake_cluster(tiny_model) as cluster:
        yield cluster


@pytest.fixture
def c(fake_cluster: Cluster) -> Iterator[Cluster]:
    """The module's fake cluster, reset for this test."""
    with reset(fake_cluster) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def topology_runs(tiny_model: Path) -> Callable[[str], Run]:
    """Each topology's EP-off run (``topology_runs.py``), started the first time a test asks for it."""
    return functools.cache(functools.partial(run_topology, tiny_model))


@pytest.fixture(scope="session")
def pcp2_pp2_handoffs(tiny_model: Path) -> Callable[[str], dict[str, Any]]:
    """Each KV layout's PCP2 x PP2 prefill and transfer (``pcp2_pp2_handoff.py``), run the first time asked for."""
    return functools.cache(functools.partial(handoff, tiny_model))
