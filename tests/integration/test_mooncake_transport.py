"""The Mooncake transport on loopback (tcp): a planned PCP2 x PP2 pull byte-exact, and its failures."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
from rank_targets import mooncake_source

from engine.parallel.grid import ParallelConfig
from engine.parallel.kv_layout import ShardedBlockAllocator, kv_ownership
from kv_transfer.layout import RequestKV, describe_cache
from kv_transfer.planner import plan_transfer
from kv_transfer.transport import Segment, TransferError
from kv_transfer.transports import mooncake  # installed by scripts/setup.sh: a missing one fails here

BS, DIM = 4, 64


def test_pull_from_every_shard_is_byte_exact() -> None:
    par = ParallelConfig(pcp=2, pp=2)
    ids = ShardedBlockAllocator(8, 2, BS, BS).allocate(7)
    own = kv_ownership(ids, par, dp=0, num_layers=2)
    caches, layouts, sources = {}, {}, []
    for h in own:
        layers = {i: torch.randn(8, BS, DIM) for i in h.layers}
        t = mooncake.MooncakeTransport()
        layouts[h.rank] = describe_cache(t.endpoint, layers)
        t.register(layouts[h.rank])
        caches[h.rank], sources = layers, [*sources, t]
    dest = {i: torch.zeros(12, BS, DIM) for i in range(2)}
    receiver = mooncake.MooncakeTransport()
    dest_layout = describe_cache(receiver.endpoint, dest)
    receiver.register(dest_layout)
    dest_blocks = [5, 6, 7, 8, 9, 10, 11]
    plan = plan_transfer(RequestKV(own, 7), layouts, dest_layout, dest_blocks)
    for src, segments in plan.pull_segments().items():
        receiver.read(layouts[src].endpoint, segments, timeout_s=10)
    for h in own:
        for j, b in zip(h.logical, h.physical):
            for i in h.layers:
                assert torch.equal(dest[i][dest_blocks[j]], caches[h.rank][i][b])
    for t in [*sources, receiver]:
        t.close()


def test_unreachable_peer_and_unregistered_memory_fail_with_their_cause() -> None:
    a, b = mooncake.MooncakeTransport(), mooncake.MooncakeTransport()
    src, dst = torch.arange(1024, dtype=torch.float32), torch.zeros(1024)
    a.register(describe_cache(a.endpoint, {0: src.view(4, 256)}))
    b.register(describe_cache(b.endpoint, {0: dst.view(4, 256)}))
    b.read(a.endpoint, [Segment(dst.data_ptr(), src.data_ptr(), 4096)], timeout_s=5)
    assert torch.equal(src, dst)
    with pytest.raises(TransferError) as e:
        b.read(a.endpoint, [Segment(dst.data_ptr(), src.data_ptr() + 8192, 16)], timeout_s=5)
    assert e.value.cause == "refused"
    with pytest.raises(TransferError) as e:
        b.read("127.0.0.1:1", [Segment(dst.data_ptr(), src.data_ptr(), 16)], timeout_s=5)
    assert e.value.cause == "peer_gone"
    a.close()
    b.close()


def test_a_killed_source_process_fails_the_read_within_its_timeout() -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=mooncake_source, args=(child,), daemon=True)
    p.start()
    try:
        assert parent.poll(60), "the source process did not start"
        endpoint, base, block = parent.recv()
        r = mooncake.MooncakeTransport()
        dst = torch.zeros(4, 256, 256)
        r.register(describe_cache(r.endpoint, {0: dst}))
        r.read(endpoint, [Segment(dst.data_ptr(), base, 4 * block)], timeout_s=10)
        assert torch.equal(dst.flatten(), torch.arange(dst.numel(), dtype=torch.float32))
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            r.read(endpoint, [Segment(dst.data_ptr(), base, 4 * block)], timeout_s=5)
        assert time.monotonic() - t0 < 6
        r.close()
    finally:
        if p.is_alive():
            p.kill()
        p.join(5)
