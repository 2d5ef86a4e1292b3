"""Mooncake's CUDA build moving KV blocks between GPU caches (tcp, two transfer engines).

Needs ``mooncake-transfer-engine-cuda13`` (GPU nodes' transport) and 2 GPUs; skipped otherwise.
"""

from __future__ import annotations

import pytest
import torch

from kv_transfer.layout import describe_cache
from kv_transfer.transport import Segment

pytestmark = pytest.mark.gpu


def _transport():  # noqa: ANN202
    try:
        from kv_transfer.transports.mooncake import MooncakeTransport

        return MooncakeTransport()
    except (ImportError, RuntimeError, OSError) as e:
        pytest.skip(f"Mooncake is not usable here: {e}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_blocks_move_from_one_gpu_cache_to_another() -> None:
    src_t, dst_t = _transport(), _transport()
    try:
        blocks, bs, dim = 64, 16, 576
        src = {i: torch.randn(blocks, bs, dim, device="cuda:0", dtype=torch.bfloat16) for i in range(2)}
        dst = {i: torch.zeros(blocks, bs, dim, device="cuda:1", dtype=torch.bfloat16) for i in range(2)}
        s_layout, d_layout = describe_cache(src_t.endpoint, src), describe_cache(dst_t.endpoint, dst)
        src_t.register(s_layout)
        dst_t.register(d_layout)
        torch.cuda.synchronize()
        pairs = [(3, 10), (4, 11), (40, 0)]  # (source block, destination block)
        segs = [Segment(d_layout.region(i).block_addr(d), s_layout.region(i).block_addr(s),
                        s_layout.region(i).block_bytes) for i in range(2) for s, d in pairs]
        dst_t.read(src_t.endpoint, segs, timeout_s=30)
        torch.cuda.synchronize()
        for i in range(2):
            for s, d in pairs:
                assert torch.equal(dst[i][d].cpu(), src[i][s].cpu())
            assert not dst[i][1].any()  # nothing else was written
    finally:
        src_t.close()
        dst_t.close()
