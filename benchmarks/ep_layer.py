"""One MoE layer under expert parallelism: its time per call with EP over ``--ranks`` processes (each holds
1/EP of the routed experts; AgRs dispatch and combine, ``engine.parallel.expert_parallel.GatherReduce``)
against the same layer holding every expert on one device, and the dispatch + combine share of it.

  python benchmarks/ep_layer.py --preset v2-lite --tokens 64 256 4096 16384     # 2 GPUs, NCCL, bf16
  python benchmarks/ep_layer.py --preset v3 --tokens 64 256 4096
  python benchmarks/ep_layer.py --preset tiny --device cpu --tokens 16 64        # CPU, gloo (checks the harness)

Each rank has ``T`` rows per call (DP replicas at the same batch: ``T`` is one replica's decode batch, or a
prefill chunk's tokens on one rank), so EP runs every expert's share of ``EP * T`` rows on each device;
the one-device layer runs its ``T`` rows on all experts. ``ratio`` is one-device time / EP time: the price
per layer of sharing experts (what an EP replica pays for holding 1/EP of them). Times are medians of
``--iters`` calls, each after a barrier, on rank 0 (the others match). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import ModelConfig  # noqa: E402
from engine.layers import MoE  # noqa: E402
from engine.parallel.expert_parallel import ExpertParallel, ExpertShard, GatherReduce  # noqa: E402


def model_config(preset: str) -> ModelConfig:
    if preset == "tiny":
        from pdctl.tiny_model import make_tiny_model

        return ModelConfig.from_pretrained(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", arch="v2", moe=True))
    from pdctl.model_presets import preset_config

    return ModelConfig.from_dict(preset_config(preset))


def build(cfg: ModelConfig, shard: ExpertShard | None, dtype: torch.dtype, device: torch.device) -> MoE:
    torch.manual_seed(0)
    moe = MoE(cfg, ExpertParallel(shard) if shard else None)
    for p in moe.parameters():
        torch.nn.init.normal_(p, 0.0, p.shape[-1] ** -0.5)
    return moe.to(device=device, dtype=dtype).eval()


def timed(fn, device: torch.device, iters: int, group: bool) -> float:  # noqa: ANN001
    """Median ms of ``fn()`` over ``iters`` calls (after two warm-ups), each after a barrier when ``group``."""
    out = []
    for i in range(iters + 2):
        if group:
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            out.append(1000 * (time.perf_counter() - t0))
    return statistics.median(out)


def measure(t: int, args: argparse.Namespace, ep: MoE, comm: GatherReduce, whole: MoE | None,
            device: torch.device) -> dict[str, float]:
    """One row count per rank: the EP layer, its dispatch + combine alone, and (rank 0) the whole layer."""
    counts = [t] * args.ranks
    x = torch.randn(t, ep.gate.weight.shape[1], dtype=ep.w13.dtype, device=device)
    w, ids = ep.gate(x)
    partial = x.new_zeros((args.ranks * t, x.shape[1]))

    def dispatch_combine() -> None:
        comm.dispatch(x, ids, w, counts)
        comm.combine(partial, counts)

    ep_ms = timed(lambda: ep(x, counts), device, args.iters, True)
    comm_ms = timed(dispatch_combine, device, args.iters, True)
    dist.barrier()
    row: dict[str, float] = {}
    if whole is not None:
        one_ms = timed(lambda: whole(x), device, args.iters, False)
        row = {"tokens": t, "ep_ms": ep_ms, "dispatch_combine_ms": comm_ms, "dispatch_combine_share": comm_ms / ep_ms,
               "one_device_ms": one_ms, "ratio": one_ms / ep_ms}
    dist.barrier()
    return row


@torch.inference_mode()
def rank_main(rank: int, args: argparse.Namespace, port: int, queue: mp.Queue) -> None:
    on_gpu = args.device == "cuda"
    device = torch.device(f"cuda:{rank}" if on_gpu else "cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.ranks, timeout=timedelta(seconds=600))
    cfg = model_config(args.preset)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    assert cfg.n_routed_experts
    ep = build(cfg, ExpertShard(rank, args.ranks, cfg.n_routed_experts), dtype, device)
    comm = GatherReduce(None, rank)
    ep.ep.comm = comm  # type: ignore[union-attr]
    whole = build(cfg, None, dtype, device) if rank == 0 else None
    rows = [measure(t, args, ep, comm, whole, device) for t in args.tokens]
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=["tiny", "v2-lite", "v3"], default="v2-lite")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 4096])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        raise SystemExit(f"--ranks {args.ranks} needs as many GPUs ({torch.cuda.device_count()} visible)")
    from engine.net import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=rank_main, args=(r, args, port, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=3600)
    for p in procs:
        p.join(60)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"one MoE layer of {args.preset}, EP{args.ranks} on {name}")
    print(f"{'rows/rank':>9} {'EP ms':>9} {'disp+comb ms':>13} {'share':>6} {'1 device ms':>12} {'ratio':>6}")
    for r in rows:
        print(f"{r['tokens']:>9} {r['ep_ms']:>9.3f} {r['dispatch_combine_ms']:>13.3f} "
              f"{r['dispatch_combine_share']:>6.2f} {r['one_device_ms']:>12.3f} {r['ratio']:>6.2f}")
    print(json.dumps({"bench": "ep_layer", "preset": args.preset, "ranks": args.ranks, "device": name,
                      "rows": rows}))


if __name__ == "__main__":
    main()
