"""Environment variables the cluster's processes read: all of them, typed, read when asked.

- ``PDCLUSTER_API_KEY``: the proxy's API key when ``--api-key`` is not given.
- ``PDCLUSTER_ADMIN_KEY``: the proxy's admin key when ``--admin-key`` is not given; ``pdctl``'s
  admin commands send it. Keys in the environment are not visible to other users in ``ps``, as
  command-line flags are, so the launcher passes them this way.
"""

from __future__ import annotations

import os

API_KEY = "PDCLUSTER_API_KEY"
ADMIN_KEY = "PDCLUSTER_ADMIN_KEY"


def api_key() -> str | None:
    return os.environ.get(API_KEY) or None


def admin_key() -> str | None:
    return os.environ.get(ADMIN_KEY) or None
