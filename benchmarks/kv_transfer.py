"""KV transfer throughput: one request's KV pulled from PCP-sharded prefill ranks into a decode rank.

  python benchmarks/kv_transfer.py                 # 32k tokens of DeepSeek-V2-Lite KV (~1 GB), loopback tcp
  python benchmarks/kv_transfer.py --tokens 4096
  python benchmarks/kv_transfer.py --device cuda   # sources on cuda:0 (another process), the pull into cuda:1,
                                                   # over nvlink_intra (--protocol tcp for the TCP path)

The request's KV (27 layers x 576 values x 2 bytes per token, in 64-token blocks) lies on
``--pcp`` source ranks, sharded block by block, each with its own Mooncake engine; the decode rank
plans the pull (``kv_transfer.planner``) and reads every source. Side by side in the same run:
(a) a memcpy of the same bytes (torch copy, layer by layer), (b) one raw Mooncake
``batch_transfer_sync_write`` of a single contiguous buffer of the same size. Sources and the
destination are in this process, so loopback tcp is what is measured. The last line of output is
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.parallel.grid import ParallelConfig  # noqa: E402
from engine.parallel.kv_layout import ShardedBlockAllocator, kv_ownership  # noqa: E402
from kv_transfer.layout import RequestKV, describe_cache  # noqa: E402
from kv_transfer.planner import TransferPlan, arrange_destination, plan_transfer  # noqa: E402
from kv_transfer.transports.mooncake import MooncakeTransport  # noqa: E402

LAYERS, DIM, BLOCK = 27, 576, 64  # BLOCK: tokens per KV block (--block-size sets it)


def sharded_request(tokens: int, pcp: int) -> tuple[int, int, list]:
    """A ``tokens``-token request's blocks sharded over ``pcp`` ranks: (blocks, blocks per rank, holders)."""
    nblocks = -(-tokens // BLOCK)
    per_rank = -(-nblocks // pcp) + 1
    ids = ShardedBlockAllocator(per_rank, pcp, BLOCK, BLOCK).allocate(nblocks)
    return nblocks, per_rank, kv_ownership(ids, ParallelConfig(pcp=pcp, kv_interleave=BLOCK), dp=0,
                                           num_layers=LAYERS)


def planned_pull(receiver: MooncakeTransport, dest: dict, own: list, nblocks: int,
                 layouts: dict) -> tuple[TransferPlan, list[int], dict]:
    """Register ``dest`` with the receiver and plan the request's pull: (plan, destination blocks, segments
    by source endpoint)."""
    dest_layout = describe_cache(receiver.endpoint, dest)
    receiver.register(dest_layout)
    request = RequestKV(own, nblocks)
    dest_blocks = arrange_destination(request, list(range(nblocks)))
    plan = plan_transfer(request, layouts, dest_layout, dest_blocks)
    return plan, dest_blocks, {layouts[src].endpoint: segs for src, segs in plan.pull_segments().items()}


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run touches fresh pages: warm-up
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--pcp", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--block-size", type=int, default=64, help="tokens per KV block (engine default 16)")
    ap.add_argument("--protocol", default=None, help="Mooncake protocol (default: tcp on cpu, nvlink_intra on cuda)")
    args = ap.parse_args()
    global BLOCK  # the helpers read it (the source process gets it as an argument)
    BLOCK = args.block_size
    if args.device == "cuda":
        main_cuda(args)
        return
    torch.set_num_threads(1)
    nblocks, per_rank, own = sharded_request(args.tokens, args.pcp)
    sources, layouts, keep = [], {}, []
    for h in own:
        layers = {i: torch.randn(per_rank, BLOCK, DIM).to(torch.bfloat16) for i in range(LAYERS)}
        t = MooncakeTransport()
        layouts[h.rank] = describe_cache(t.endpoint, layers)
        t.register(layouts[h.rank])
        sources.append(t)
        keep.append(layers)
    dest = {i: torch.zeros(nblocks, BLOCK, DIM, dtype=torch.bfloat16) for i in range(LAYERS)}
    receiver = MooncakeTransport()
    plan, dest_blocks, segments = planned_pull(receiver, dest, own, nblocks, layouts)
    nbytes = plan.total_bytes

    def pull() -> None:
        receiver.read_all(segments, timeout_s=120)

    t_pull = best(pull, args.repeats)
    # Byte-exact check of the last pull.
    for h, layers in zip(own, keep):
        for j, b in zip(h.logical, h.physical):
            assert torch.equal(dest[0][dest_blocks[j]], layers[0][b]), "transfer is not byte-exact"

    src_flat = [torch.randn(nblocks, BLOCK, DIM).to(torch.bfloat16) for _ in range(LAYERS)]
    t_memcpy = best(lambda: [d.copy_(s) for d, s in zip(dest.values(), src_flat)], args.repeats)

    raw_src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    raw_dst = torch.zeros(nbytes, dtype=torch.uint8)
    a, b = MooncakeTransport(), MooncakeTransport()
    a._engine.register_memory(raw_src.data_ptr(), nbytes)
    b._engine.register_memory(raw_dst.data_ptr(), nbytes)

    def raw() -> None:
        rc = a._engine.batch_transfer_sync_write(b.endpoint, [raw_src.data_ptr()], [raw_dst.data_ptr()], [nbytes])
        if rc != 0:
            raise RuntimeError(f"raw Mooncake write failed ({rc})")

    t_raw = best(raw, args.repeats)
    gbps, memcpy_gbps, raw_gbps = nbytes / t_pull / 1e9, nbytes / t_memcpy / 1e9, nbytes / t_raw / 1e9
    print(f"{args.tokens} tokens, {nbytes / 1e9:.2f} GB in {nblocks} blocks of {BLOCK} tokens from {args.pcp} "
          f"shards ({len(plan.copies)} copies after coalescing)")
    print(f"planned pull:      {t_pull * 1e3:8.1f} ms  {gbps:6.2f} GB/s")
    print(f"memcpy:            {t_memcpy * 1e3:8.1f} ms  {memcpy_gbps:6.2f} GB/s")
    print(f"raw mooncake write:{t_raw * 1e3:8.1f} ms  {raw_gbps:6.2f} GB/s  (pull = {gbps / raw_gbps:.0%} of it)")
    print(json.dumps({
        "bench": "kv_transfer", "tokens": args.tokens, "bytes": nbytes, "pcp": args.pcp,
        "copies": len(plan.copies), "gbps": round(gbps, 3), "memcpy_gbps": round(memcpy_gbps, 3),
        "mooncake_raw_gbps": round(raw_gbps, 3), "ratio_to_raw": round(gbps / raw_gbps, 3),
    }))
    for t in [*sources, receiver]:
        t.close()


def _sources(conn, own, per_rank: int, protocol: str, block: int) -> None:  # noqa: ANN001
    """Process of the prefill side (CUDA IPC wants the peer in another process): every shard's cache
    on cuda:0 with its own Mooncake engine; answers the layouts, then layer 0's blocks to check."""
    torch.cuda.set_device(0)
    caches, layouts, transports = [], {}, []
    for h in own:
        g = torch.Generator(device="cuda:0").manual_seed(h.rank)
        layers = {i: torch.randn(per_rank, block, DIM, device="cuda:0", generator=g).to(torch.bfloat16)
                  for i in range(LAYERS)}
        t = MooncakeTransport(protocol=protocol)
        layouts[h.rank] = describe_cache(t.endpoint, layers)
        t.register(layouts[h.rank])
        caches.append(layers)
        transports.append(t)
    torch.cuda.synchronize()
    conn.send(layouts)
    conn.recv()  # the pulls are done
    conn.send([{j: layers[0][b].cpu() for j, b in zip(h.logical, h.physical)} for h, layers in zip(own, caches)])
    conn.recv()
    for t in transports:
        t.close()


def main_cuda(args: argparse.Namespace) -> None:
    import multiprocessing as mp

    protocol = args.protocol or "nvlink_intra"
    nblocks, per_rank, own = sharded_request(args.tokens, args.pcp)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sources, args=(child, own, per_rank, protocol, BLOCK), daemon=True)
    proc.start()
    try:
        if not parent.poll(300):
            raise RuntimeError("the source process did not answer")
        layouts = parent.recv()
        torch.cuda.set_device(1)
        dest = {i: torch.zeros(nblocks, BLOCK, DIM, dtype=torch.bfloat16, device="cuda:1") for i in range(LAYERS)}
        receiver = MooncakeTransport(protocol=protocol)
        plan, dest_blocks, segments = planned_pull(receiver, dest, own, nblocks, layouts)
        torch.cuda.synchronize()
        nbytes = plan.total_bytes

        def pull() -> None:
            receiver.read_all(segments, timeout_s=120)
            torch.cuda.synchronize()

        t_pull = best(pull, args.repeats)
        parent.send("check")
        want = parent.recv()
        for blocks in want:
            for j, data in blocks.items():
                assert torch.equal(dest[0][dest_blocks[j]].cpu(), data), "transfer is not byte-exact"
        parent.send("stop")
        src = [torch.randn(nblocks, BLOCK, DIM, device="cuda:0").to(torch.bfloat16) for _ in range(LAYERS)]
        torch.cuda.synchronize()

        def copy() -> None:
            for d, s_ in zip(dest.values(), src):
                d.copy_(s_, non_blocking=True)
            torch.cuda.synchronize()

        t_copy = best(copy, args.repeats)
        receiver.close()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    gbps, copy_gbps = nbytes / t_pull / 1e9, nbytes / t_copy / 1e9
    print(f"{args.tokens} tokens, {nbytes / 1e9:.2f} GB in {nblocks} blocks of {BLOCK} tokens from {args.pcp} "
          f"shards on cuda:0 into cuda:1 ({len(plan.copies)} copies after coalescing), Mooncake {protocol}")
    print(f"planned pull:        {t_pull * 1e3:8.2f} ms  {gbps:7.1f} GB/s")
    print(f"torch cuda:0->1 copy:{t_copy * 1e3:8.2f} ms  {copy_gbps:7.1f} GB/s  (pull = {gbps / copy_gbps:.0%} of it)")
    print(json.dumps({
        "bench": "kv_transfer", "device": "cuda", "protocol": protocol, "tokens": args.tokens, "bytes": nbytes,
        "pcp": args.pcp, "copies": len(plan.copies), "gbps": round(gbps, 2), "torch_copy_gbps": round(copy_gbps, 2),
        "ratio_to_copy": round(gbps / copy_gbps, 3), "pull_ms": round(t_pull * 1e3, 3),
    }))


if __name__ == "__main__":
    main()
