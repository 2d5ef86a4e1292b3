"""Prefill of one long prompt with PCP against PCP1, in one run: speedup and MFU.

  python benchmarks/pcp_prefill.py --preset v2-lite --tokens 32768 --pcp 2   # on 2 GPUs (one rank each)
  python benchmarks/pcp_prefill.py                                           # tiny model, CPU, gloo

PCP1 is the in-process engine (what a single-GPU user runs); PCP>1 runs on rank processes through
the same LLMEngine (driver-side scheduling, step plans over pipes, NCCL/gloo collectives), so the
figure includes every overhead of the parallel path. Each timed run is one engine step holding the
whole prompt (``max_num_batched_tokens`` = prompt length) that also samples the first token.
The last line of output is one JSON object with all figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from presets import H200_BF16_PEAK_TFLOPS, V2_LITE, prefill_flops  # noqa: E402

from engine.config import ModelConfig  # noqa: E402
from engine.engine_config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.parallel.replica import ParallelNode  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def time_prefills(eng: LLMEngine, n: int, repeats: int, vocab: int) -> list[float]:
    """Seconds of each timed n-token prefill step (after one warm-up); blocks are freed after each."""
    times = []
    for r in range(repeats + 1):
        ids = torch.randint(10, vocab - 10, (n,), generator=torch.Generator().manual_seed(r)).tolist()
        seq = eng.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0))
        if torch.cuda.is_available() and eng.device.type == "cuda":
            torch.cuda.synchronize(eng.device)
        t0 = time.perf_counter()
        eng.step()  # samples the first token: the logits are on the host, so the step is complete
        if r:
            times.append(time.perf_counter() - t0)
        eng.abort(seq.request_id)
        assert eng.num_used_blocks == 0
    return times


def run(config: EngineConfig, n: int, repeats: int) -> tuple[list[float], str]:
    mc = ModelConfig.from_pretrained(config.model)
    par = config.parallel()
    if par.world_size == 1:
        eng = LLMEngine(config)
        try:
            return time_prefills(eng, n, repeats, mc.vocab_size), "in-process"
        finally:
            del eng
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    node = ParallelNode(config, config.max_model_len or n)
    try:
        eng = LLMEngine(config, node.replica(0))
        return time_prefills(eng, n, repeats, mc.vocab_size), f"{par.world_size} rank processes"
    finally:
        node.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=["tiny", "v2-lite"], default="tiny")
    ap.add_argument("--tokens", type=int, default=None, help="prompt length (v2-lite: 32768, tiny: 2048)")
    ap.add_argument("--pcp", type=int, nargs="+", default=[2], help="PCP sizes to compare with PCP1")
    ap.add_argument("--kv-layout", choices=["sharded", "replicated"], default="sharded")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="pdbench-"))
    if args.preset == "tiny":
        from pdctl.tiny_model import make_tiny_model

        n = args.tokens or 2048
        model_dir = make_tiny_model(tmp / "tiny", arch="v2", moe=True, seed=0)
        kw = dict(dtype="float32", device="cpu", load_format="auto")
    else:
        n = args.tokens or 32768
        model_dir = tmp / "v2-lite"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(V2_LITE))
        kw = dict(dtype="bfloat16", device="cuda", load_format="dummy")
    blocks = -(-n // 16) + 16
    common = dict(model=str(model_dir), skip_tokenizer_init=True, max_model_len=n + 16,
                  max_num_batched_tokens=n, max_num_seqs=1, num_kv_blocks=blocks, kv_layout=args.kv_layout, **kw)
    mc = ModelConfig.from_pretrained(str(model_dir))
    flops = prefill_flops(mc, n)
    on_gpu = kw["device"] == "cuda"
    device = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    res: dict = {"bench": "pcp_prefill", "preset": args.preset, "device": device, "tokens": n,
                 "kv_layout": args.kv_layout}
    base = None
    for pcp in [1, *args.pcp]:
        times, how = run(EngineConfig(pcp=pcp, **common), n, args.repeats)
        s = sorted(times)[len(times) // 2]
        line = f"PCP{pcp} ({how}): {s * 1e3:9.1f} ms  {n / s:9.0f} tok/s  {flops / s / 1e12:7.1f} TFLOP/s"
        res[f"pcp{pcp}_ms"] = round(s * 1e3, 2)
        if on_gpu:
            mfu = flops / s / (H200_BF16_PEAK_TFLOPS * 1e12 * pcp)  # per GPU: PCP ranks use PCP GPUs
            line += f"  MFU {mfu:.1%} (per GPU)"
            res[f"pcp{pcp}_mfu"] = round(mfu, 4)
        if base is None:
            base = s
        else:
            res[f"pcp{pcp}_speedup"] = round(base / s, 3)
            line += f"  speedup {base / s:.2f}x"
        print(line, flush=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
