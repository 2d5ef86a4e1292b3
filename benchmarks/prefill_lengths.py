"""Prefill of prompts whose lengths vary, as serving sees them: the prompt attention's kernels side by side.

  python3 benchmarks/prefill_lengths.py              # V2-Lite's shape on dummy weights, bf16, one GPU
  python3 benchmarks/prefill_lengths.py --requests 40 --min-tokens 1024 --max-tokens 12288 --bucket 512
  python3 benchmarks/prefill_lengths.py --warm       # every bucket planned first, as a node does at start-up

cuDNN's fused attention is 2-3x faster than FlashAttention on a shape it has planned for, but builds a
plan for every new shape first (37-50 ms on an H200), and prompt lengths rarely repeat
(docs/benchmarks.md). One engine, one request at a time to its first token, each pair of requests a new
random length in [min, max] run once in each form (which goes first alternates: the second run of a
length finds cuBLAS's choices for its row count made):

- ``auto``: the engine's default (FlashAttention below ``attention_ops.CUDNN_MIN_ROWS`` rows, cuDNN above);
- ``bucketed``: cuDNN with the prompt padded to a multiple of ``--bucket`` rows from
  ``--bucket-min-rows`` (``attention_ops.CUDNN_BUCKET``): a plan per bucket, built the first time a
  bucket is met and counted in that request's time, as serving would pay it (with ``--warm``, planned
  before the first request instead, as a node with ``CUDNN_BUCKET`` set does at start-up).

It prints each form's mean, median and p90 time to the first token, and bucketed / auto; the last line
is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefill_host import first_token_ms  # noqa: E402
from presets import V2_LITE  # noqa: E402

from engine import attention_ops  # noqa: E402
from engine.engine_config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=30, help="requests per form")
    ap.add_argument("--min-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=12288)
    ap.add_argument("--bucket", type=int, default=512)
    ap.add_argument("--bucket-min-rows", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm", action="store_true",
                    help="plan every bucket first (attention_ops.warm_cudnn_buckets: what a node does at start-up "
                         "when CUDNN_BUCKET is set), so the bucketed form runs in its steady state")
    args = ap.parse_args()
    if args.bucket <= 0 or not 0 < args.min_tokens <= args.max_tokens:
        sys.exit("need --bucket > 0 and 0 < --min-tokens <= --max-tokens")
    model = Path(tempfile.mkdtemp()) / "v2-lite"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(V2_LITE))
    t0 = time.perf_counter()
    eng = LLMEngine(EngineConfig(model=str(model), skip_tokenizer_init=True, dtype="bfloat16",
                                 max_model_len=max(32768, args.max_tokens + 1), max_num_batched_tokens=args.max_tokens,
                                 load_format="dummy", device=args.device, gpu_memory_utilization=0.5,
                                 enable_prefix_caching=False))
    print(f"engine ready in {time.perf_counter() - t0:.1f}s", flush=True)
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    vocab = eng.model_config.vocab_size
    forms = {"auto": 0, "bucketed": args.bucket}
    first_token_ms(eng, [rng.randrange(2, vocab) for _ in range(args.min_tokens)], params)  # warm-up (flash)
    times: dict[str, list[float]] = {f: [] for f in forms}
    attention_ops.CUDNN_BUCKET_MIN_ROWS = args.bucket_min_rows
    warm_s = None
    if args.warm:
        attention_ops.CUDNN_BUCKET = args.bucket
        t0 = time.perf_counter()
        mc = eng.model_config
        n = attention_ops.warm_cudnn_buckets(mc.num_attention_heads, mc.qk_head_dim, mc.v_head_dim, args.max_tokens,
                                             torch.bfloat16, torch.device(args.device))
        warm_s = time.perf_counter() - t0
        print(f"planned {n} buckets in {warm_s:.1f}s", flush=True)
    for i in range(args.requests):
        n = rng.randint(args.min_tokens, args.max_tokens)
        for form, bucket in (forms.items() if i % 2 == 0 else reversed(forms.items())):
            attention_ops.CUDNN_BUCKET = bucket
            times[form].append(first_token_ms(eng, [rng.randrange(2, vocab) for _ in range(n)], params))
            assert eng.num_used_blocks == 0
        print(f"request {i + 1}/{args.requests}: " + ", ".join(f"{f} {t[-1]:.1f} ms" for f, t in times.items()),
              flush=True)
    attention_ops.CUDNN_BUCKET = 0
    res: dict = {"bench": "prefill_lengths", "device": torch.cuda.get_device_name(), "requests": args.requests,
                 "min_tokens": args.min_tokens, "max_tokens": args.max_tokens, "bucket": args.bucket,
                 "bucket_min_rows": args.bucket_min_rows, "warm_s": round(warm_s, 2) if warm_s is not None else None}
    print(f"{'form':>9} {'mean ms':>9} {'p50 ms':>8} {'p90 ms':>8}")
    for form, ts in times.items():
        p90 = sorted(ts)[int(0.9 * (len(ts) - 1))]
        print(f"{form:>9} {statistics.mean(ts):9.1f} {statistics.median(ts):8.1f} {p90:8.1f}")
        res[form] = {"mean_ms": round(statistics.mean(ts), 2), "p50_ms": round(statistics.median(ts), 2),
                     "p90_ms": round(p90, 2)}
    res["bucketed_over_auto_mean"] = round(res["bucketed"]["mean_ms"] / res["auto"]["mean_ms"], 3)
    print(f"bucketed / auto (mean): {res['bucketed_over_auto_mean']:.3f}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
