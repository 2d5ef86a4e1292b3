"""Transfer state: an ordered enum with FAILED lowest, so ranks agree by taking the minimum.

Every rank taking part in one request's transfer reports its own state; the request's state is
the minimum (``agree``): one failed rank fails the transfer, and it is DONE only when all are.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class TransferState(enum.IntEnum):
    FAILED = 0
    WAITING = 1  # blocks held (sender) or allocated (receiver), nothing moved yet
    TRANSFERRING = 2
    DONE = 3


def agree(states: Iterable[TransferState]) -> TransferState:
    """The state of a transfer from its ranks' states (what a MIN all-reduce computes)."""
    states = list(states)
    if not states:
        raise ValueError("no rank reported a transfer state")
    return min(states)
