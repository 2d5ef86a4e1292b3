"""The chaos suite shares the e2e tests' cluster helper (tests/e2e/e2e_cluster.py) and the fake nodes
of the proxy's integration tests (tests/integration/proxy_fakes.py)."""

from __future__ import annotations

import sys
from pathlib import Path

for folder in ("e2e", "integration"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / folder))
