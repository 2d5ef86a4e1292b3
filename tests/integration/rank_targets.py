"""Rank targets for the launcher tests (module level, so spawned processes can import them)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from engine.parallel.launcher import RankContext


def allreduce_server(ctx: RankContext) -> None:
    """Serves ('sum', x): all-reduces x over the world; ('crash',): exits hard; ('stop',): returns."""
    while True:
        msg = ctx.conn.recv()
        if msg[0] == "stop":
            return
        if msg[0] == "crash":
            os._exit(3)
        if msg[0] == "raise":
            raise RuntimeError("boom on purpose")
        t = torch.tensor([float(msg[1])])
        dist.all_reduce(t)
        ctx.conn.send(("sum", ctx.rank, t.item(), ctx.payload))
