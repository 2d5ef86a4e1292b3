"""What the e2e and chaos tests share: a running cluster (started and stopped as pdctl does), its
handles, and its nodes' used KV blocks (a module name unique across test folders)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import RegistryConfig
from cluster.registry import Registry
from pdctl.launcher import down, read_state, up
from pdctl.topology import Topology

ADMIN_KEY = "e2e-admin"


@dataclass
class Cluster:
    url: str
    run_dir: Path
    model: Path
    admin: httpx.Client

    def nodes(self) -> dict[str, dict]:
        r = self.admin.get("/admin/nodes")
        r.raise_for_status()
        return {n["node_id"]: n for n in r.json()["nodes"]}


@contextmanager
def running_cluster(topo: Topology, run_dir: Path, model: Path, run_dirs: list[Path]) -> Iterator[Cluster]:
    """``topo`` started as ``pdctl up`` starts it, stopped as ``pdctl down`` stops it; fails if anything it
    started outlives it."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    state = up(topo, run_dir, timeout_s=240)
    run_dirs.append(run_dir)
    admin = httpx.Client(base_url=state.proxy_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    try:
        yield Cluster(state.proxy_url, run_dir, model, admin)
    finally:
        admin.close()
        try:
            down(run_dir, grace_s=10)
        finally:
            run_dirs.remove(run_dir)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]
    for p in left:
        p.kill()
    assert not left, f"the cluster left processes behind: {[(p.pid, p.name()) for p in left]}"


def used_blocks(c: Cluster) -> dict[str, int]:
    """Each node's used KV blocks as its own heartbeat reports them (read from the registry, so it
    works with the proxy gone too)."""
    state = read_state(c.run_dir)
    assert state is not None
    registry = Registry(RegistryConfig(url=state.registry_url, cluster=state.cluster))
    try:
        return {n.info.node_id: sum(r.used_blocks for r in n.replicas) for n in registry.nodes()}
    finally:
        registry.close()


def wait_all_free(c: Cluster, timeout_s: float = 20.0) -> dict[str, int]:
    """``used_blocks`` once no node uses any, or as it is after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = used_blocks(c)
        if not any(used.values()) or time.monotonic() > deadline:
            return used
        time.sleep(0.3)


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass
class Page:
    """One ``/metrics`` page: its samples by name and labels, and every sample name its families declare
    (a counter without children yet declares ``name_total``)."""

    samples: Samples
    declared: set[str]

    def total(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels``."""
        return sum(v for (n, lbl), v in self.samples.items() if n == name and labels.items() <= dict(lbl).items())


_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",), "info": ("_info",)}


def scrape(url: str) -> Page:
    r = httpx.get(url, timeout=10)
    r.raise_for_status()
    families = list(text_string_to_metric_families(r.text))
    return Page({(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples},
                {f.name + suffix for f in families for suffix in _SUFFIXES.get(f.type, ("",))}
                | {s.name for f in families for s in f.samples})
