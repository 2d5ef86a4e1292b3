"""Rank targets for the launcher tests (module level, so spawned processes can import them)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from engine.parallel.rank_group import RankContext
from engine.parallel.rank_messages import Stop


def allreduce_server(ctx: RankContext) -> None:
    """Serves ('sum', x): all-reduces x over the world; ('crash',): exits hard; Stop: returns."""
    while True:
        msg = ctx.conn.recv()
        if isinstance(msg, Stop):
            return
        if msg[0] == "crash":
            os._exit(3)
        if msg[0] == "raise":
            raise RuntimeError("boom on purpose")
        t = torch.tensor([float(msg[1])])
        dist.all_reduce(t)
        ctx.conn.send(("sum", ctx.rank, t.item(), ctx.payload))


def mooncake_source(conn) -> None:  # noqa: ANN001 - a multiprocessing Connection
    """Registers a 1 MiB tensor (values 0..) with a Mooncake transport, reports where, then waits."""
    from kv_transfer.layout import describe_cache
    from kv_transfer.transports.mooncake import MooncakeTransport

    t = MooncakeTransport()
    buf = torch.arange(4 * 256 * 256, dtype=torch.float32).view(4, 256, 256)  # 4 "blocks" of 256 KiB
    t.register(describe_cache("src", {0: buf}))
    conn.send((t.endpoint, buf.data_ptr(), buf[0].numel() * 4))
    conn.recv()  # until killed or told to stop
