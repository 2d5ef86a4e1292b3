"""Native engine throughput: prefill time / tokens/s and MFU, decode tokens/s.

  python benchmarks/engine.py                      # tiny model on CPU (made on the fly)
  python benchmarks/engine.py --preset v2-lite     # DeepSeek-V2-Lite-shaped random bf16 model on a GPU
  python benchmarks/engine.py --preset v3 --layers 8 --quantization fp8   # 8 of DeepSeek-V3's layers, FP8

The last line of output is one JSON object with all figures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from presets import H200_BF16_PEAK_TFLOPS, H200_FP8_PEAK_TFLOPS, H200_HBM_TB_S, decode_step_bytes, prefill_flops  # noqa: E402

from engine.engine_config import EngineConfig  # noqa: E402
from engine.executor import LocalExecutor  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from pdctl.model_presets import preset_config  # noqa: E402

# decode mode -> (replay CUDA graphs, engine.mla.DECODE_KERNEL, overlapped steps: async_scheduling)
MODES = {"graph": (True, "triton", True), "graph-sync": (True, "triton", False), "eager": (False, "triton", True),
         "eager-torch": (False, "torch", True)}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


_PROMPTS = itertools.count()  # every prefill's prompt a fresh one: a repeated prompt would hit the prefix cache


def time_prefill(eng: LLMEngine, n: int, repeats: int) -> float:
    """Median seconds of one n-token prefill step (the request is aborted after it)."""
    times = []
    for r in range(repeats + 1):
        seed = next(_PROMPTS)
        ids = torch.randint(10, eng.model_config.vocab_size - 10, (n,), generator=torch.Generator().manual_seed(seed))
        seq = eng.add_request(ids.tolist(), SamplingParams(max_tokens=1, temperature=0.0))
        _sync(eng.device)
        t0 = time.perf_counter()
        eng.step()
        _sync(eng.device)
        if r:  # the first run is warm-up
            times.append(time.perf_counter() - t0)
        eng.abort(seq.request_id)
    assert eng.num_used_blocks == 0
    return sorted(times)[len(times) // 2]


def time_decode(eng: LLMEngine, batch: int, prompt_len: int, steps: int, profiled: dict | None = None,
                trace: Path | None = None) -> float:
    """Decode tokens/s with `batch` requests of `prompt_len` prompt tokens, over `steps` steps.

    With ``profiled`` (a dict), the timed steps run under torch.profiler and it gets, per step: the
    kernels launched, the GPU's busy time (the union of kernel intervals), its idle time between kernels (short
    gaps and long ones) and the wall time; with ``trace`` too, the profile is written there as a Chrome trace.
    """
    g = torch.Generator().manual_seed(1)
    seqs = [
        eng.add_request(torch.randint(10, 1000, (prompt_len,), generator=g).tolist(),
                        SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
        for _ in range(batch)
    ]
    while any(s.num_computed < len(s.prompt_token_ids) for s in seqs):
        eng.step()
    for _ in range(3):  # warm-up decode steps
        eng.step()
    _sync(eng.device)
    prof = None
    if profiled is not None:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        prof = torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        prof.__enter__()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    _sync(eng.device)
    dt = time.perf_counter() - t0
    if prof is not None and profiled is not None:
        prof.__exit__(None, None, None)
        profiled.update(kernel_profile(prof, steps, dt))
        if trace is not None:
            prof.export_chrome_trace(str(trace))  # chrome://tracing or ui.perfetto.dev: host calls over kernels
    for s in seqs:
        eng.abort(s.request_id)
    while eng.has_unfinished():  # a step still in flight (async_scheduling) keeps their blocks until it ran
        eng.step()
    assert eng.num_used_blocks == 0
    return batch * steps / dt


def kernel_profile(prof, steps: int, wall_s: float) -> dict:
    """Kernels per step and the GPU's busy share of the wall time, from a finished torch.profiler run."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.end - e.time_range.start
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:24]
    busy_us, end = 0.0, float("-inf")
    gaps: list[float] = []  # idle stretches between kernels (µs): launch gaps, or the GPU waiting for the host
    for a, b in spans:  # union of the kernels' intervals (µs)
        if b > end:
            if end > float("-inf") and a > end:
                gaps.append(a - end)
            busy_us += b - max(a, end)
            end = b
    long_gaps = [g for g in gaps if g > 50]
    return {"kernels_per_step": round(len(spans) / steps, 1), "gpu_busy_ms_per_step": round(busy_us / 1e3 / steps, 3),
            "step_ms": round(wall_s * 1e3 / steps, 3), "gpu_busy_share": round(busy_us / 1e6 / wall_s, 4),
            "idle_ms_per_step_in_gaps_under_50us": round((sum(gaps) - sum(long_gaps)) / 1e3 / steps, 3),
            "idle_gaps_over_50us_per_step": round(len(long_gaps) / steps, 1),
            "idle_ms_per_step_in_gaps_over_50us": round(sum(long_gaps) / 1e3 / steps, 3),
            "top_kernels_ms_per_step": {name[:90]: round(us / 1e3 / steps, 3) for name, us in top}}


def profile(eng: LLMEngine, n: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    time_prefill(eng, n, 1)  # warm up
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if eng.device.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        time_prefill(eng, n, 1)
    key = "cuda_time_total" if eng.device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60))
    with torch_profile(activities=acts) as prof:
        time_decode(eng, 1, 256, 4)
    print(prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["tiny", "v2-lite", "v3"], default="tiny")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers of the v2-lite / v3 shape (default: the published count)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prefill-tokens", type=int, nargs="+", default=None)
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--decode-modes", nargs="+", choices=list(MODES), default=None,
                    help="decode paths measured side by side: graph (CUDA graphs, fused attention, overlapped steps), "
                         "graph-sync (the same, one step at a time), eager (fused attention), eager-torch (gather "
                         "+ einsum attention); default: graph, eager, eager-torch on CUDA")
    ap.add_argument("--decode-prompt", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cpu-threads", type=int, default=1)
    ap.add_argument("--quantization", choices=["none", "fp8"], default="none",
                    help="fp8: the model's config declares DeepSeek's block FP8 (v2-lite: dummy weights on the FP8 "
                         "grid; weights are dequantized at load today, engine/fp8.py)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_ds_mla"], default="auto",
                    help="the KV cache's row format (engine/kv_format.py)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="the engine's share of the GPU's memory (default: EngineConfig's)")
    ap.add_argument("--block-size", type=int, default=16,
                    help="tokens per KV block (64: FlashMLA's page, which its fp8 decode needs)")
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table of a prefill and decode")
    ap.add_argument("--profile-decode", action="store_true",
                    help="also profile each decode measurement: kernels per step, GPU busy share (slows it)")
    ap.add_argument("--trace-dir", default=None,
                    help="with --profile-decode: each decode profile as a Chrome trace there (decode_bB_MODE.json)")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="pdbench-"))
    if args.preset == "tiny":
        from pdctl.tiny_model import make_tiny_model

        model_dir = make_tiny_model(tmp / "tiny", arch="v2", moe=True, seed=0,
                                    quantize=None if args.quantization == "none" else args.quantization)
        kw = dict(dtype="float32", max_model_len=4096, max_num_batched_tokens=4096, load_format="auto")
        prefill = args.prefill_tokens or [512, 2048]
    else:
        model_dir = tmp / args.preset
        model_dir.mkdir()
        cfg = preset_config(args.preset, None if args.quantization == "none" else args.quantization,
                            num_layers=args.layers)
        (model_dir / "config.json").write_text(json.dumps(cfg))
        kw = dict(dtype="bfloat16", max_model_len=32768, max_num_batched_tokens=32768, load_format="dummy")
        prefill = args.prefill_tokens or [4096, 16384]
    if args.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    t0 = time.perf_counter()
    eng = LLMEngine(EngineConfig(model=str(model_dir), device=args.device, skip_tokenizer_init=True,
                                 cpu_threads=args.cpu_threads, max_num_seqs=max(args.decode_batches),
                                 kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size, **kw))
    load_s = time.perf_counter() - t0
    cfg = eng.model_config
    dev = eng.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    ex = eng.executor
    print(f"model {args.preset} on {name} ({ex.dtype}), loaded in {load_s:.1f}s, {ex.cache.num_blocks} KV blocks")
    if args.profile:
        profile(eng, prefill[0])
    kv_row = eng.config.kv_format(cfg).row_bytes
    res: dict = {"bench": "engine", "preset": args.preset, "layers": cfg.num_hidden_layers, "device": name,
                 "dtype": str(ex.dtype).split(".")[-1],
                 "kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization, "kv_row_bytes": kv_row,
                 "block_size": args.block_size,
                 "kv_blocks": ex.cache.num_blocks}
    for n in prefill:
        s = time_prefill(eng, n, args.repeats)
        flops = prefill_flops(cfg, n)
        mfu = flops / s / (H200_BF16_PEAK_TFLOPS * 1e12) if dev.type == "cuda" else None
        print(f"prefill {n:>6} tokens: {s * 1e3:9.1f} ms  {n / s:10.0f} tok/s  {flops / s / 1e12:7.1f} TFLOP/s"
              + (f"  MFU {mfu:.1%}" if mfu is not None else ""))
        res[f"prefill_{n}_ms"] = round(s * 1e3, 2)
        res[f"prefill_{n}_tok_s"] = round(n / s, 1)
        res[f"prefill_{n}_tflops"] = round(flops / s / 1e12, 2)
        if mfu is not None:
            res[f"prefill_{n}_mfu"] = round(mfu, 4)
            if args.quantization == "fp8":  # the same FLOPs against the FP8 tensor-core peak
                res[f"prefill_{n}_mfu_fp8_peak"] = round(flops / s / (H200_FP8_PEAK_TFLOPS * 1e12), 4)
    from engine import mla

    runner = getattr(ex, "runner", None)
    graphs = runner.graphs if runner is not None else None
    modes = args.decode_modes or (["graph", "eager", "eager-torch"] if dev.type == "cuda" else ["eager-torch"])
    for b in args.decode_batches:
        by_mode = {}
        step_bytes = decode_step_bytes(cfg, b, args.decode_prompt + args.decode_steps // 2, kv_row_bytes=kv_row,
                                       expert_elem=1 if args.quantization == "fp8" else None)
        roof_ms = step_bytes / (H200_HBM_TB_S * 1e12) * 1e3
        res[f"decode_b{b}_roofline_ms"] = round(roof_ms, 3)
        for m in modes:
            use_graphs, mla.DECODE_KERNEL, overlap = MODES[m]
            eng.overlap = overlap and isinstance(ex, LocalExecutor)
            if runner is not None:
                runner.graphs = graphs if use_graphs else None
            by_mode[m] = tps = time_decode(eng, b, args.decode_prompt, args.decode_steps)
            step_ms = b / tps * 1e3
            print(f"decode batch {b:>3} (prompt {args.decode_prompt}), {m:>11}: {tps:10.1f} tok/s, "
                  f"{step_ms:7.2f} ms/step, H200 memory roofline {roof_ms:.2f} ms ({step_ms / roof_ms:.1f}x)")
            res[f"decode_b{b}_{m}_step_ms"] = round(step_ms, 3)
            res[f"decode_b{b}_tok_s" if m == modes[0] else f"decode_b{b}_{m}_tok_s"] = round(tps, 1)
            if args.profile_decode and dev.type == "cuda":
                prof: dict = {}
                trace = Path(args.trace_dir) / f"decode_b{b}_{m}.json" if args.trace_dir else None
                if trace is not None:
                    trace.parent.mkdir(parents=True, exist_ok=True)
                time_decode(eng, b, args.decode_prompt, min(args.decode_steps, 8), prof, trace)
                print(f"    profiled: {prof}")
                res[f"decode_b{b}_{m}_profile"] = prof
        for m in modes[1:]:
            ratio = by_mode[modes[0]] / by_mode[m]
            print(f"decode batch {b:>3}: {modes[0]} / {m} = {ratio:.2f}x")
            res[f"decode_b{b}_{modes[0]}_over_{m}"] = round(ratio, 3)
    if runner is not None:
        runner.graphs = graphs
    res["decode_mode"] = modes[0]
    res["graph_sizes"] = graphs.sizes if graphs is not None else []
    print(json.dumps(res))


if __name__ == "__main__":
    main()
