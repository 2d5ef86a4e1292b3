"""What the e2e tests share: the running cluster's handles (a module name unique across test folders)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx

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
