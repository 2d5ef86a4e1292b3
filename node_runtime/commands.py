"""The commands a node sends its engine threads: one vocabulary for both roles.

gRPC handlers, transfer threads and a decode node's pipe reader talk to an engine thread
(``node_runtime.engine_loop.EngineLoop``) with ``send(command)``; the thread dispatches on these
with ``match``. A decode node's replica processes get the same dataclasses over their pipe, so a
``Start``'s job pickles there (``decode_node.replica.Job``); a prefill node's never leaves its
process (``prefill_node.worker.PrefillJob``). What a role adds for itself stays in its worker (the
decode replica's ``Pulled``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

J = TypeVar("J")


@dataclass(frozen=True)
class Start(Generic[J]):
    """Take a request: the role's job for it."""

    job: J


@dataclass(frozen=True)
class Abort:
    """Free whatever the request holds (queued, running, pulling, or held under a lease); ``done(found)``
    is called from the engine thread once it is free (in-process callers only)."""

    request_id: str
    done: Callable[[bool], None] | None = None


@dataclass(frozen=True)
class AbortAll:
    """Abort every request (the node is stopping): each fails with ``why``."""

    why: str


@dataclass(frozen=True)
class Release:
    """The receiver has the request's KV and its lease has ended: free the blocks held for it."""

    request_id: str
